"""Weight sync, actor → inference engines (``docs/weights.md``).

  buckets      pack (name, tensor) streams into flat one-dtype buckets (SGLang's "flattened_bucket") and back
  sync         WeightSender: the weight-sync group (TCPStore on port 0 + gloo/NCCL) and push(); load_from_disk
  fingerprint  sha256 of weights on the actor and, via /get_weights_by_name, on an engine
  check        EngineChecker: a sync's spot fingerprint and version on every engine; which engines are gone
  push         ActorSync: the actor's sync as one call (push, check, push again without an engine that left)
"""

from relax_hpc.weights.buckets import DEFAULT_BUCKET_BYTES, Bucket, TensorMeta, iter_buckets, pack, unpack
from relax_hpc.weights.check import EngineChecker
from relax_hpc.weights.fingerprint import engine_fingerprint, fingerprint
from relax_hpc.weights.push import SYNC_TRIES, ActorSync, Synced
from relax_hpc.weights.sync import WeightSender, WeightSyncError, load_from_disk, push_from_actor

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "TensorMeta", "iter_buckets", "pack", "unpack", "fingerprint",
           "engine_fingerprint", "WeightSender", "WeightSyncError", "load_from_disk", "push_from_actor",
           "EngineChecker", "ActorSync", "Synced", "SYNC_TRIES"]
