"""Samples → micro-batch tensors, padded or packed (and per-sample results back), for the Megatron forward.

A sample is a :class:`TrainingSample`, the trainer's side of the sample seam (the data plan,
:mod:`relax_hpc.train.plan`, builds them from the chunk's columns as the field table,
:mod:`relax_hpc.exchange.fields`, says; tests and tools build them with :meth:`TrainingSample.of`), with:

* ``tokens``: LongTensor[L] (or list of ints), prompt + response;
* ``response_start``: int ≥ 1, index in ``tokens`` of the first response token (the response is
  ``tokens[response_start:]``, R = L − response_start tokens);
* ``loss_mask`` (optional): [R] 0/1 over the response tokens (default all ones; a sample Relax marked
  ``remove_sample`` has all zeros);
* ``advantages`` ([R], per token; :meth:`TrainingSample.of` spreads one float over the response);
* ``old_log_probs`` [R] (π_old; optional only with ``use_rollout_logprobs``), ``ref_log_probs`` [R]
  (optional), ``rollout_log_probs`` [R] (optional), ``teacher_log_probs`` [R] (optional; OPD).

Two layouts of a micro-batch:

* **padded** (:func:`make_micro_batch`, ``train.micro_batch_size`` samples): one row per sample, right padding
  and no attention mask: attention is causal, so pad tokens after a sequence never change the logits of its real
  tokens, and no mask tensor has to be built or sent through the pipeline.
* **packed** (:func:`make_packed_micro_batch`, ``train.max_tokens_per_micro_batch`` tokens): one row holding the
  samples back to back, with their boundaries (``cu_seqlens``) for Megatron's ``thd`` layout: attention stays
  inside each sample and RoPE positions restart at each (the core attention and megatron's RoPE read them), so
  no token is padding and each sample's logits are those of its own row in the padded layout.
  :func:`pack` decides which samples share a micro-batch (first fit, longest first).

Log-probs are computed only at response positions (logits at position p score token p+1), which keeps the
vocab-sized tensors as small as the responses: ``logit_index`` holds those positions as indices into the
micro-batch's flattened [B·S] logits, so the same gather serves both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relax_hpc.exchange.fields import RESPONSE_VALUES


@dataclass(slots=True)
class TrainingSample:
    """One sample at the trainer's seam (the fields above). Tensors are views into the step's verified chunk
    bytes; ``old_log_probs`` is set once π_old is known (from actor_fwd, or the actor's own forward pass)."""

    tokens: torch.Tensor
    response_start: int
    loss_mask: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None  # OPD: the teacher's log-prob of each response token [R]
    routed_experts: torch.Tensor | None = None  # routing replay: the engine's expert ids, flat [L - 1, layers, top_k]
    pixel_values: torch.Tensor | None = None  # a VLM: the image processor's patches of its images, flat [patches·dim]
    image_grid_thw: torch.Tensor | None = None  # a VLM: each image's (t, h, w) patch grid, flat [images·3]
    pixel_values_videos: torch.Tensor | None = None  # a VLM: its videos' patches, flat [patches·dim]
    video_grid_thw: torch.Tensor | None = None  # a VLM: each video's (t, h, w) patch grid, flat [videos·3]
    input_features: torch.Tensor | None = None  # an omni model: its clips' log-mel frames, flat [frames·mel]
    audio_feature_lens: torch.Tensor | None = None  # an omni model: each clip's frames [clips]

    @classmethod
    def of(cls, tokens: Any, response_start: int, *, advantage: float | None = None, **fields: Any) -> TrainingSample:
        """A sample from plain values (tests, tools): ``tokens`` as a LongTensor, one ``advantage`` spread over the
        response's tokens as ``advantages``, the other ``fields`` as they are (lists become tensors where used)."""
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if advantage is not None:
            if "advantages" in fields:
                raise ValueError("give advantage (one float) or advantages (one per response token), not both")
            fields["advantages"] = torch.full((max(t.numel() - int(response_start), 0),), float(advantage))
        return cls(tokens=t, response_start=int(response_start), **fields)


def field(sample: TrainingSample, name: str, default=None):
    """``sample.name``, or ``default`` when it is None."""
    if not isinstance(sample, TrainingSample):  # the seam's one type: a dict's keys would go unchecked
        raise TypeError(f"a sample is a TrainingSample, not {type(sample).__name__}. Fix: build it with "
                        "relax_hpc.train.batch.TrainingSample.of(tokens, response_start, advantage=..., ...)")
    v = getattr(sample, name)
    return default if v is None else v


def tokens_of(sample) -> torch.Tensor:
    return torch.as_tensor(field(sample, "tokens"), dtype=torch.long).reshape(-1)


def response_bounds(sample, n: int | None = None) -> tuple[int, int]:
    """(response_start, response length R) of a sample of ``n`` tokens (None: counted); checks that there is at
    least one prompt and one response token."""
    if n is None:
        n = tokens_of(sample).numel()
    start = field(sample, "response_start")
    if start is None:
        raise ValueError("sample has no response_start")
    start = int(start)
    if not 1 <= start < n:
        raise ValueError(f"response_start = {start} must be in [1, {n}) for a sample of {n} tokens "
                         "(at least one prompt token and one response token)")
    return start, n - start


@dataclass
class MicroBatch:
    """One forward pass worth of samples. ``B`` rows × ``S`` tokens: padded, one row per sample (``n_real`` real,
    the rest all-pad filler for PP); packed, one row of samples back to back (``packed`` set). ``T`` longest
    response. Train fields are None for forward-only use."""

    tokens: torch.Tensor  # [B, S] long
    position_ids: torch.Tensor  # [B, S] long, restarting at each sample
    logit_index: torch.Tensor  # [n_real, T] index into the flattened [B·S] logits of those scoring each response token
    targets: torch.Tensor  # [n_real, T] the response token ids (pad where t >= R)
    valid: torch.Tensor  # [n_real, T] bool, t < R
    response_lens: list[int]
    lengths: list[int]  # each sample's prompt + response tokens
    n_real: int
    index: list[int] | None = None  # which of the planned samples these are, in row order (None: in order)
    packed: object | None = None  # megatron PackedSeqParams (qkv_format "thd") for a packed micro-batch
    loss_mask: torch.Tensor | None = None  # [n_real, T] float: valid × the sample's loss mask
    advantages: torch.Tensor | None = None  # [n_real, T]
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None  # [n_real, T] OPD: the teacher's, where every sample has them
    # routing replay: [B·S, layers × top_k] the engine's expert ids of each token of the flattened ``tokens`` (a
    # sample's last token, padding, tokens no engine ran: -1, its router's own choice), where every sample has them
    routed_experts: torch.Tensor | None = None
    # a VLM: the images of the samples, concatenated in row order (None when no sample has any): pixel_values
    # [patches, dim], image_grid_thw [images, 3]; image_limits: per real row, where its image pads end (its response
    # start; 0 without images): an image pad id from there on is a token, not an image (relax_hpc.train.vlm)
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_limits: list[int] | None = None
    image_counts: list[int] | None = None  # per real row, its images (a multi-turn sample's may follow its start)
    pixel_values_videos: torch.Tensor | None = None  # a VLM's videos, as pixel_values: [patches, dim]
    video_grid_thw: torch.Tensor | None = None  # [videos, 3]
    # an omni model: the samples' clips, concatenated in row order: input_features [frames, mel], audio_feature_lens
    # [clips]; audio_limits: per real row, its response start (0 without audio): audio pads before it are its clips'
    input_features: torch.Tensor | None = None
    audio_feature_lens: list[int] | None = None
    audio_limits: list[int] | None = None
    weight: float = 1.0  # this micro-batch's share of the global loss (samples or tokens)

    @property
    def num_loss_tokens(self) -> float:
        return float(self.loss_mask.sum()) if self.loss_mask is not None else float(sum(self.response_lens))

    @property
    def real_tokens(self) -> int:
        """Tokens of the samples themselves (the rest of ``tokens`` is padding)."""
        return sum(self.lengths)


def end_to_end(rows: Sequence) -> tuple[torch.Tensor, list[int]]:
    """Per-sample values (tensors, arrays or lists, each flattened) laid end to end, and each one's length. One
    concatenation where every row is already a tensor: a step holds thousands of short samples, and a torch call
    per sample adds up."""
    parts = [r if type(r) is torch.Tensor else torch.as_tensor(r) for r in rows]
    try:
        flat = torch.cat(parts).reshape(-1)  # rows of one shape but the first: each row's values stay together
    except RuntimeError:  # rows of other ranks (a 0-d one, [r] beside [r, 1])
        parts = [p.reshape(-1) for p in parts]
        flat = torch.cat(parts)
    return flat, [p.numel() for p in parts]


def _per_response_token(samples: Sequence, name: str, lens: list[int], valid: torch.Tensor, *, required: bool,
                         ones: bool = False) -> torch.Tensor | None:
    """The samples' ``name`` values, one per response token, as ``[n, T]`` float32 (zero past each response): None
    unless every sample has them (``required``: an error; ``ones``: a sample without them gets ones). One
    concatenation and one masked write for the micro-batch, not a copy per sample (1,760 samples a step in the
    quickstart), and each sample's count checked against its response."""
    vals = [field(s, name) for s in samples]
    if any(v is None for v in vals):
        if required:
            raise ValueError(f"sample has no {name}")
        if not ones:
            return None
        vals = [torch.ones(r) if v is None else v for v, r in zip(vals, lens)]
    flat, counts = end_to_end(vals)
    for c, r in zip(counts, lens):
        if c != r:
            raise ValueError(f"{name} has {c} values for a response of {r} tokens")
    out = torch.zeros(valid.shape, dtype=torch.float32)
    out[valid] = flat.to(torch.float32)  # row by row, each response's values first: valid is t < R
    return out


def make_micro_batch(samples: Sequence, *, pad_id: int, train: bool, seq_len: int | None = None,
                     rows: int | None = None, max_seq_len: int | None = None, multiple: int = 1) -> MicroBatch:
    """Pad ``samples`` into one micro-batch; ``seq_len``/``rows`` force a fixed shape (pipeline p2p needs it), and
    the length is rounded up to a ``multiple`` (sequence parallelism splits it over the TP ranks)."""
    if not samples:
        raise ValueError("empty micro-batch")
    toks = [tokens_of(s) for s in samples]
    lens = [t.numel() for t in toks]
    longest = max(lens)
    _check_len(longest, max_seq_len)
    S = _round_up(seq_len or longest, multiple)
    B = rows or len(samples)
    assert S >= longest and B >= len(samples)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    for i, t in enumerate(toks):
        tokens[i, : lens[i]] = t
    position_ids = torch.arange(S, dtype=torch.long).unsqueeze(0).expand(B, S).contiguous()
    return _finish(samples, lens, tokens, position_ids, [i * S for i in range(len(samples))], train=train)


def make_packed_micro_batch(samples: Sequence, *, pad_id: int, train: bool, seq_len: int | None = None,
                            max_seq_len: int | None = None, multiple: int = 1) -> MicroBatch:
    """Pack ``samples`` back to back into one row (Megatron's ``thd`` layout). ``seq_len`` forces the row's length
    (pipeline p2p needs one shape); the row is rounded up to a ``multiple``. Padding, if any, is one more sequence
    at the end, so no real token attends to it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not samples:
        raise ValueError("empty micro-batch")
    if any(field(s, "image_grid_thw") is not None and torch.as_tensor(field(s, "image_grid_thw")).numel()
           for s in samples):
        raise ValueError("samples with images cannot be packed (M-RoPE positions are per padded row). Fix: remove "
                         "train.max_tokens_per_micro_batch")
    toks = [tokens_of(s) for s in samples]
    lens = [t.numel() for t in toks]
    _check_len(max(lens), max_seq_len)
    total = sum(lens)
    S = _round_up(max(seq_len or 0, total), multiple)
    tokens = torch.full((1, S), pad_id, dtype=torch.long)
    tokens[0, :total] = torch.cat(toks)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    if S > total:
        bounds.append(S)
    position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]).unsqueeze(0)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    mb = _finish(samples, lens, tokens, position_ids, bounds[: len(samples)], train=train)
    mb.packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                max_seqlen_kv=longest)
    return mb


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Which samples share a micro-batch of at most ``budget`` tokens: first fit, longest first (fewer micro-batches
    than in order when lengths spread). Each group lists sample indices in ascending order; groups in the order
    they were opened. A sample longer than the budget gets a group of its own (the recipe check keeps
    ``train.max_seq_len`` within the budget)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(budget - lengths[i])
    return [sorted(g) for g in groups]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_len(longest: int, max_seq_len: int | None) -> None:
    if max_seq_len is not None and longest > max_seq_len:
        raise ValueError(f"a sample has {longest} tokens, more than train.max_seq_len = {max_seq_len}")


def _finish(samples: Sequence, lengths: list[int], tokens: torch.Tensor, position_ids: torch.Tensor,
            offsets: list[int], *, train: bool) -> MicroBatch:
    """The response gather (``logit_index`` into the flattened logits, targets, valid) and, for training, the
    per-token columns, for samples of ``lengths`` tokens starting at ``offsets`` of the flattened ``tokens``."""
    bounds = [response_bounds(s, n) for s, n in zip(samples, lengths)]
    lens = [r for _, r in bounds]
    T = max(lens)
    ar = torch.arange(T)
    first = torch.tensor([o + s - 1 for o, (s, _) in zip(offsets, bounds)])  # the logits scoring response token 0
    valid = ar.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    logit_index = (first.unsqueeze(1) + ar.unsqueeze(0)).clamp(max=tokens.numel() - 2)
    targets = tokens.reshape(-1)[logit_index + 1]
    mb = MicroBatch(tokens=tokens, position_ids=position_ids, logit_index=logit_index, targets=targets,
                    valid=valid, response_lens=lens, lengths=[s + r for s, r in bounds], n_real=len(samples))
    mb.routed_experts = _routed(samples, tokens, offsets)
    _images(mb, samples, [s for s, _ in bounds])
    _images(mb, samples, [s for s, _ in bounds], videos=True)
    _audio(mb, samples, [s for s, _ in bounds])
    if not train:
        return mb
    mb.loss_mask = _per_response_token(samples, "loss_mask", lens, valid, required=False, ones=True)
    mb.advantages = _per_response_token(samples, "advantages", lens, valid, required=True)
    for name in RESPONSE_VALUES:  # the table's per-response-token values (log-probs), where every sample has them
        if name != "loss_mask":
            setattr(mb, name, _per_response_token(samples, name, lens, valid, required=False))
    return mb


def _routed(samples: Sequence, tokens: torch.Tensor, offsets: list[int]) -> torch.Tensor | None:
    """The engine's routed experts laid out as the flattened ``tokens`` (:attr:`MicroBatch.routed_experts`), or None
    unless every sample carries them. A sample's L - 1 rows (SGLang's: every token but the last) go to its tokens'
    positions (-1 rows among them: tokens no engine ran); the rest (its last token, padding) hold -1 too, which
    :mod:`relax_hpc.train.routing` leaves to the trainer's own router."""
    rows = [field(s, "routed_experts") for s in samples]
    if not rows or any(r is None for r in rows):
        return None
    lens = [tokens_of(s).numel() - 1 for s in samples]
    width = {torch.as_tensor(r).numel() // n for r, n in zip(rows, lens)}
    if len(width) != 1:
        raise ValueError(f"routed_experts: the samples of a micro-batch carry {sorted(width)} expert ids per token")
    w = width.pop()
    out = torch.full((tokens.numel(), w), -1, dtype=torch.long)
    for r, n, o in zip(rows, lens, offsets):
        t = torch.as_tensor(r).reshape(-1)
        if t.numel() != n * w:
            raise ValueError(f"routed_experts: {t.numel()} expert ids for {n} tokens of {w} each")
        out[o: o + n] = t.reshape(n, w).long()
    return out


def _images(mb: MicroBatch, samples: Sequence, starts: list[int], videos: bool = False) -> None:
    """The samples' images on ``mb`` (:attr:`MicroBatch.pixel_values`, ``image_grid_thw``, ``image_limits``), in
    sample order, where some sample has any. Each sample's ``pixel_values`` is flat: its row width is its patches
    (the grid's t·h·w summed) into its values, the same for all (the processor's C·T·P·P). ``videos``: the videos'
    (``pixel_values_videos``, ``video_grid_thw``) the same way; a row's limit is its start where it has either."""
    pix_name, grid_name = ("pixel_values_videos", "video_grid_thw") if videos else ("pixel_values", "image_grid_thw")
    grids = [field(s, grid_name) for s in samples]
    if all(g is None or torch.as_tensor(g).numel() == 0 for g in grids):
        return
    pix, thw, limits, counts, dims = [], [], [], [], set()
    for i, (s, g, start) in enumerate(zip(samples, grids, starts)):
        g = torch.zeros(0, 3, dtype=torch.long) if g is None else torch.as_tensor(g).reshape(-1, 3).long()
        p = torch.as_tensor(field(s, pix_name, torch.zeros(0))).reshape(-1)
        patches = int(g.prod(dim=1).sum())
        if (patches == 0) != (p.numel() == 0) or (patches and p.numel() % patches):
            raise ValueError(f"sample {i} of the micro-batch: {p.numel()} {pix_name} for grids "
                             f"{g.tolist()} ({patches} patches)")
        if patches:
            dims.add(p.numel() // patches)
            pix.append(p.reshape(patches, -1))
            thw.append(g)
        limits.append(start if patches else 0)
        counts.append(int(g.shape[0]) if patches else 0)
    if len(dims) != 1:
        raise ValueError(f"{pix_name}: the samples of a micro-batch have patches of {sorted(dims)} values")
    if videos:  # a video is in the prompt (no multi-turn observation has one): its limit is its start
        mb.pixel_values_videos, mb.video_grid_thw = torch.cat(pix).float(), torch.cat(thw)
        mb.image_limits = [max(a, b) for a, b in zip(mb.image_limits or [0] * len(limits), limits)]
        return
    mb.pixel_values = torch.cat(pix).float()
    mb.image_grid_thw = torch.cat(thw)
    mb.image_limits = limits
    mb.image_counts = counts


def _audio(mb: MicroBatch, samples: Sequence, starts: list[int]) -> None:
    """The samples' clips on ``mb`` (:attr:`MicroBatch.input_features`, ``audio_feature_lens``, ``audio_limits``),
    in sample order, where some sample has any."""
    lens = [field(s, "audio_feature_lens") for s in samples]
    if all(n is None or torch.as_tensor(n).numel() == 0 for n in lens):
        return
    feats, all_lens, limits, mels = [], [], [], set()
    for i, (s, n, start) in enumerate(zip(samples, lens, starts)):
        n = [] if n is None else [int(v) for v in torch.as_tensor(n).reshape(-1)]
        f = torch.as_tensor(field(s, "input_features", torch.zeros(0))).reshape(-1)
        frames = sum(n)
        if (frames == 0) != (f.numel() == 0) or (frames and f.numel() % frames):
            raise ValueError(f"sample {i} of the micro-batch: {f.numel()} feature values for clips of {n} frames")
        if frames:
            mels.add(f.numel() // frames)
            feats.append(f.reshape(frames, -1))
            all_lens += n
        limits.append(start if frames else 0)
    if len(mels) != 1:
        raise ValueError(f"input_features: the samples of a micro-batch have frames of {sorted(mels)} values")
    mb.input_features = torch.cat(feats).float()
    mb.audio_feature_lens = all_lens
    mb.audio_limits = limits


@dataclass(frozen=True)
class GlobalStats:
    """What a train step needs of the whole global batch when each DP rank holds only its share: the loss
    weights divide by ``n`` (or ``loss_tokens``), and with PP every micro-batch is padded to ``max_seq_len``."""

    n: int  # samples in the global batch
    loss_tokens: float  # loss-mask tokens in the global batch
    max_seq_len: int  # longest prompt + response in the global batch


@dataclass
class Share:
    """One DP rank's samples of a global batch, with the global batch's :class:`GlobalStats`."""

    samples: list
    stats: GlobalStats


def loss_tokens(sample) -> float:
    _, r = response_bounds(sample)
    m = field(sample, "loss_mask")
    return float(r if m is None else torch.as_tensor(m, dtype=torch.float32).sum())


def share_of(samples: Sequence, dp: int, dp_rank: int, *, balance: bool = False) -> Share:
    """This rank's :class:`Share` of a global batch that every rank holds whole (``balance``: dealt by
    :func:`balanced_shares`, else a contiguous run)."""
    lens = [tokens_of(s).numel() for s in samples]
    stats = GlobalStats(n=len(samples), loss_tokens=sum(loss_tokens(s) for s in samples), max_seq_len=max(lens, default=0))
    if balance:
        return Share([samples[i] for i in balanced_shares(lens, dp)[dp_rank]], stats)
    return Share(dp_shard(samples, dp, dp_rank), stats)


def dp_shard(samples: Sequence, dp: int, dp_rank: int) -> list:
    """This data-parallel rank's contiguous share of the global batch (sizes differ by at most one)."""
    n = len(samples)
    base, extra = divmod(n, dp)
    start = dp_rank * base + min(dp_rank, extra)
    return list(samples[start: start + base + (1 if dp_rank < extra else 0)])


def balanced_shares(lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Positions 0..n-1 dealt to ``dp`` ranks with :func:`dp_shard`'s share sizes (rank r gets as many as it would
    contiguously) and token sums as even as a greedy longest-first deal makes them (Relax's ``--balance-data``,
    Megatron's sequence-length balancing): each position, longest first, goes to the rank with the fewest tokens
    that still has room; ties go to the lower rank, then the lower position, so every rank computes the same deal.
    Each rank's positions are returned in ascending order."""
    n = len(lengths)
    base, extra = divmod(n, dp)
    room = [base + (1 if r < extra else 0) for r in range(dp)]
    tokens = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        r = min((r for r in range(dp) if room[r]), key=lambda r: (tokens[r], r))
        out[r].append(i)
        tokens[r] += int(lengths[i])
        room[r] -= 1
    return [sorted(x) for x in out]


def token_imbalance(lengths: Sequence[int], shares: Sequence[Sequence[int]]) -> float:
    """max over ranks of a rank's tokens / the mean rank's: 1.0 is even; the slowest rank sets a step's pace."""
    sums = [sum(int(lengths[i]) for i in sh) for sh in shares]
    mean = sum(sums) / len(sums) if sums else 0.0
    return max(sums) / mean if mean > 0 else 1.0


def chunks(samples: Sequence, size: int) -> list[list]:
    return [list(samples[i: i + size]) for i in range(0, len(samples), size)]
