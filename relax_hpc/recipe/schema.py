"""The recipe schema: one dataclass per section, defaults included.

Each package owns its sections, in its ``config`` module: ``algorithm`` and ``opd`` (:mod:`relax_hpc.algo.config`),
``train`` (:mod:`relax_hpc.train.config`), ``rollout``, ``data`` and ``genrm`` (:mod:`relax_hpc.rollout.config`),
``rollout.engine`` (:mod:`relax_hpc.engines.config`), ``logging.wandb`` (:mod:`relax_hpc.ops.config`).
This module holds the rest (the run, its roles' resources, Slurm, checkpoints, logging: each read across packages)
and composes them into :class:`Recipe`, so that one place lists everything a recipe may say. Field types are
limited to what :mod:`relax_hpc.recipe.build` understands: int, float, bool, str, ``X | None``, ``Literal[...]``,
``list[X]``, ``dict[str, X]`` and nested dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from relax_hpc.algo.config import AlgorithmConfig, OPDConfig
from relax_hpc.ops.config import WandbConfig
from relax_hpc.rollout.config import DataConfig, GenRMConfig, RolloutConfig
from relax_hpc.seed import DEFAULT_SEED
from relax_hpc.train.config import TrainConfig
from relax_hpc.train.forward_config import ForwardConfig

ROLE_NAMES = ("actor", "rollout", "reference", "actor_fwd", "genrm", "teacher")
"""Roles that run as Slurm job steps, in het-group order. ``advantages`` runs beside the controller."""


@dataclass
class RunConfig:
    name: str | None = None  # run name; default: the recipe file's name without .yaml
    runs_root: str = "./runs"  # where run directories are made (shared filesystem on a cluster)
    seed: int = DEFAULT_SEED  # one seed for data order, sampling and init
    steps: int = 1  # number of rollout steps (Relax: num_rollout)


@dataclass
class RoleGroup:
    """Resources of one role: a Slurm het component, or a step inside another role's component."""

    enabled: bool = True
    nodes: int = 1
    tasks_per_node: int = 1  # ranks per node (one per GPU on GPU nodes)
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem: str | None = None  # per-node memory, Slurm syntax ("16G"); None = partition default
    share_with: str | None = None  # run on that role's nodes (srun --overlap) instead of its own component
    # rollout only: spare nodes for scale-out without --attach. The component holds `nodes` nodes; the run's own
    # engines start on `initial` of them, and relax-scale RUN rollout=+N starts engines as new steps on the rest
    elastic: ElasticNodes | None = None


@dataclass
class ElasticNodes:
    initial: int = 1  # nodes the run's own engines start on (one engine step per task slot)
    max: int | None = None  # refused: the component's size is roles.rollout.nodes (kept to say so, by name)


@dataclass
class Roles:
    actor: RoleGroup = field(default_factory=RoleGroup)
    rollout: RoleGroup = field(default_factory=RoleGroup)
    reference: RoleGroup = field(default_factory=lambda: RoleGroup(enabled=False))
    actor_fwd: RoleGroup = field(default_factory=lambda: RoleGroup(enabled=False))
    genrm: RoleGroup = field(default_factory=lambda: RoleGroup(enabled=False))  # judge engines (GenRMConfig)
    teacher: RoleGroup = field(default_factory=lambda: RoleGroup(enabled=False))  # OPD teacher engines (OPDConfig)


@dataclass
class ContainerConfig:
    """The image the role and engine steps run in (docs/containers.md); the controller stays on the host."""

    runtime: Literal["pyxis", "apptainer"] | None = None  # pyxis: srun --container-image; apptainer: apptainer exec
    image: str = ""  # pyxis: an enroot URI or a .sqsh path; apptainer: a .sif path (or docker://...)
    # SRC:DST[:ro|rw], absolute paths; the run directory, relax_hpc's checkout and the working directory are
    # mounted at their own paths as well (the steps' command lines name them)
    mounts: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set inside the container, over the image's own values
    workdir: str | None = None  # None: the directory relax-submit ran in (relative recipe paths resolve there)
    python: str = "python3"  # the image's interpreter that runs the steps (not the host's)


@dataclass
class SlurmConfig:
    partition: str | None = None  # None = the cluster's default partition
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None  # node features, e.g. "a100"
    time: str = "01:00:00"  # wall-clock limit, Slurm syntax ([D-]HH:MM:SS)
    job_name: str | None = None  # default: relax-<run name>
    sbatch_extra: list[str] = field(default_factory=list)  # extra #SBATCH options, e.g. "--mail-type=END"
    srun_args: list[str] = field(default_factory=list)  # extra srun options for every role step (container hooks)
    env: dict[str, str] = field(default_factory=dict)  # environment exported to the controller and every step
    signal_lead_s: int = 120  # --signal=B:USR2@lead: seconds before the limit to checkpoint
    requeue: bool = True  # requeue the job after a checkpoint on signal or preemption
    max_requeues: int = 5  # give up (fail) after this many restarts
    # srun --mpi for role steps. none (no --mpi flag; Slurm's MpiDefault applies): rank 0 puts its address in the run
    # directory (the file rendezvous, no MPI needed); pmix: the address goes by MPI (mpi4py, the [mpi] extra)
    mpi: Literal["pmix", "none"] = "none"
    # hetjob: one Slurm heterogeneous job, a component per role group; single: one homogeneous allocation of all the
    # groups' nodes, each role's steps placed on its own nodes (srun --relative); auto: hetjob where the partition
    # takes het jobs (relax-submit asks sbatch --test-only, relax-doctor says it), else single (docs/slurm.md)
    layout: Literal["auto", "hetjob", "single"] = "auto"
    template: str | None = None  # your own Jinja2 sbatch template (default: relax_hpc/sbatch/hetjob.sbatch.j2)
    container: ContainerConfig | None = None  # run the role and engine steps in this image; None: on the host
    # one GPU's memory in GiB (nvidia-smi's MiB / 1024; relax-doctor prints it on a GPU node): the memory plan
    # (relax-submit --dry-run) is checked against it, and a recipe that does not fit is refused; None: no verdict
    gpu_memory_gb: float | None = None


@dataclass
class ModelConfig:
    path: str | None = None  # HF model directory (config, tokenizer, safetensors)
    # a vision-language model's vision tower (encoder and merger) is not trained and not sent by the weight sync
    # (Relax --freeze-vision-model with --freeze-vision-projection); refused for a text model
    freeze_vision: bool = False
    # an omni model's audio tower is not trained and not sent by the weight sync; false (training it) is not wired
    # yet and is refused (relax_hpc.train.omni)
    freeze_audio: bool = True


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only on signal and at the end)
    keep: int = 2  # keep the last K checkpoints
    max_restarts: int = 2  # a step that crashes, is killed or hangs: restart every step from the latest checkpoint, at most this many times per job attempt


@dataclass
class HealthConfig:
    """Two tiers of recovery (docs/reliability.md): a role other than the actor that dies or goes silent is started
    again alone; the actor's death, or a role failing again soon, restarts every step (``checkpoint.max_restarts``)."""

    max_role_restarts: int = 3  # restarts of a role alone per job attempt (0: every failure restarts every step)
    window_s: float = 600.0  # a role failing again this soon after its restart alone: every step restarts instead


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: WandbConfig | None = None  # None: no W&B
    notify_urls: list[str] = field(default_factory=list)  # Apprise URLs
    heartbeat_s: float = 2.0  # roles report this often
    heartbeat_timeout_s: float = 60.0  # a role silent this long is dead
    task_timeout_s: float = 1800.0  # a role whose task makes no progress this long is hung (restarted); 0: off
    plot_marks: dict[str, float] = field(default_factory=dict)  # labelled levels drawn on reward.png, e.g. {chance: 0.1, ceiling: 1.0}
    check_weight_sync: bool = True  # after each weight sync, compare a spot fingerprint of the weights on every engine with the actor's (weights/fingerprint_match)


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    mode: Literal["colocate", "fully_async"] = "colocate"
    max_staleness: int = 0  # fully_async: how many steps rollout may run ahead of training
    # bounded: step N uses weights of step N-1-k or newer (whatever is synced); fixed: exactly N-1-k (the sync
    # waits for rollout), so an async run and its resume follow one trajectory
    staleness_mode: Literal["bounded", "fixed"] = "bounded"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    opd: OPDConfig | None = None  # on-policy distillation (docs/distillation.md); None: off
    train: TrainConfig = field(default_factory=TrainConfig)
    forward: ForwardConfig | None = None  # reference and actor_fwd: their own TP/PP and token budget (Relax --ref-actor-config); None: train's
    roles: Roles = field(default_factory=Roles)
    genrm: GenRMConfig = field(default_factory=GenRMConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)  # the role tier of recovery
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def role(self, name: str) -> RoleGroup:
        return getattr(self.roles, name)
