"""Property test of the whole exchange: any interleaving of producers, field writers, consumers (that ack,
release, hold, lose replies or die), broker restarts from the journal (with torn tails), clears and file
damage. Checked against a model after every step, and at the end after draining:

- every sample is delivered (read and acked) to each task at most once, and exactly once for every chunk
  that was never damaged; nothing uncleared is lost across restarts;
- a chunk with a damaged file never yields data from it, and is never handed out once quarantined;
- requests return the FIFO prefix the rules say; leases survive restarts;
- the staleness gate answers as the rule says, and the journal shows it held at every start.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relax_hpc.exchange import Broker, ChunkQuarantined, DamagedChunk, read_chunk, replay
from relax_hpc.exchange.chunk import partition_dir
from relax_hpc.exchange.staleness import audit, satisfies

from .helpers import add_fields, bump_byte, fresh_dir, produce, sample_fields, tokens_for, truncate

TASKS = {
    "fwd": ("tokens",),  # actor_fwd → log_probs
    "ref": ("tokens",),  # reference → ref_log_probs
    "adv": ("tokens", "reward", "log_probs", "ref_log_probs"),  # advantages → advantages, returns
    "train": ("tokens", "log_probs", "ref_log_probs", "advantages"),
}
WRITES = {"fwd": ("actor_fwd", ("log_probs",)), "ref": ("reference", ("ref_log_probs",)),
          "adv": ("advantages", ("advantages", "returns"))}
HOLDERS = [f"{t}-{i}" for t in TASKS for i in (0, 1)]
COEF = {"log_probs": -0.001, "ref_log_probs": -0.002, "advantages": 0.5, "returns": 0.25}
MAX_STEPS = 5


def derived(field: str, sid: int, length: int) -> np.ndarray:
    return tokens_for(sid, length).astype(np.float32) * np.float32(COEF[field]) + np.float32(sid)


class MChunk:
    def __init__(self, ref, sids, lens, order):
        self.ref, self.sids, self.lens, self.order = ref, sids, lens, order
        self.fields = set(ref.fields)
        self.files = {f: ref.path for f in ref.fields}  # field -> path
        self.damaged: dict[str, str] = {}  # path -> "flip" | "truncate"
        self.quarantined = False
        self.consumed: set[str] = set()

    def checked(self, fields) -> set[str]:
        """Files a hand-out stats / a read opens for these fields."""
        return {self.ref.path} | {self.files[f] for f in fields}


class Exchange(RuleBasedStateMachine):
    @initialize(k=st.sampled_from([0, 1, 2]), auto=st.booleans(),
                first=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=3), min_size=1, max_size=3))
    def setup(self, k, auto, first):
        self.root = fresh_dir("relax-xchg-sm-")
        self.k, self.auto = k, auto
        self.b = self._broker()
        self.steps: dict[int, dict] = {}  # uncleared: {"ended": bool, "chunks": [ids]}
        self.cleared: set[int] = set()
        self.next_step = 0
        self.chunks: dict[str, MChunk] = {}  # every chunk ever announced
        self.leases: dict[str, tuple[str, str, list[str]]] = {}  # outstanding: id -> (task, holder, chunk ids)
        self.pending: dict[str, list[int]] = {}  # held leases already read: id -> sids read fine
        self.delivered: Counter = Counter()  # (task, sid) -> acked deliveries
        self.quarantined: set[str] = set()
        self.next_sid = 0
        self.order = 0
        self.start_step()  # step 0, with a few chunks, so that consumers have work from the start
        for lens in first:
            self._produce(0, "roll-a", lens)

    def _broker(self) -> Broker:
        return Broker(self.root, tasks=TASKS, max_staleness=self.k, auto_clear=self.auto)

    # ------------------------------------------------------------------------------------ model ---

    def _complete(self, step: int) -> bool:
        s = self.steps[step]
        return s["ended"] and all(self.chunks[c].quarantined or set(TASKS) <= self.chunks[c].consumed for c in s["chunks"])

    def _sync(self) -> None:
        """Quarantines and (auto) clears the broker did: check they are allowed, then follow them."""
        q = {d["chunk"] for d in self.b.damaged()}
        assert q >= self.quarantined
        for cid in q - self.quarantined:
            event("a chunk was quarantined")
            assert self.chunks[cid].damaged, f"{cid} quarantined but never damaged"
            self.chunks[cid].quarantined = True
        self.quarantined = q
        expect = sorted(s for s in self.steps if not (self.auto and self._complete(s)))
        assert self.b.uncleared() == expect
        for s in [s for s in self.steps if s not in expect]:
            event("a step was auto-cleared")
            self._forget_step(s)

    def _forget_step(self, step: int) -> None:
        gone = set(self.steps.pop(step)["chunks"])
        self.cleared.add(step)
        for lid, (task, holder, ids) in list(self.leases.items()):
            ids = [c for c in ids if c not in gone]
            if ids:
                self.leases[lid] = (task, holder, ids)
            else:
                del self.leases[lid]
                self.pending.pop(lid, None)
        assert not partition_dir(self.root, step).exists()

    def _eligible(self, task: str) -> list[MChunk]:
        want = set(TASKS[task])
        leased = {c for t, _, ids in self.leases.values() if t == task for c in ids}
        out = []
        for step in sorted(self.steps):
            for cid in self.steps[step]["chunks"]:
                c = self.chunks[cid]
                if c.quarantined or task in c.consumed or cid in leased or not want <= c.fields:
                    continue
                if any(self.chunks[cid].damaged.get(p) == "truncate" for p in c.checked(want)):
                    continue  # the hand-out stat catches it
                out.append(c)
        return out

    def _process(self, lid: str, task: str, refs) -> list[int]:
        """Read each chunk as a consumer would, check the data, write the task's fields; the sids read fine."""
        fine = []
        for ref in refs:
            c = self.chunks[ref.id]
            bad = c.quarantined or any(p in c.damaged for p in c.checked(TASKS[task]))
            try:
                data = read_chunk(ref, TASKS[task])
            except DamagedChunk:
                assert bad, f"{ref.id} is sound but did not read"
                event("a damaged chunk was refused at read")
                assert self.b.report_damaged(ref.id, "test") is True
                self._sync()
                continue
            assert not bad, f"{ref.id} has a damaged file and was read anyway"
            assert data["tokens"] is not None and len(data["tokens"]) == len(c.sids)
            for i, (sid, n) in enumerate(zip(c.sids, c.lens)):
                assert data["tokens"][i].tolist() == tokens_for(sid, n).tolist()
                for f in TASKS[task]:
                    if f in COEF:
                        assert data[f][i].tobytes() == derived(f, sid, n).tobytes()
            fine += c.sids
            if task in WRITES:
                writer, fields = WRITES[task]
                cols = {f: [derived(f, s, n) for s, n in zip(c.sids, c.lens)] for f in fields}
                try:
                    added = add_fields(self.b, ref, writer, cols)
                except ChunkQuarantined:
                    added = False
                    self._sync()
                if added:
                    side = self.b.chunks(ref.step)
                    newref = next(x for x in side if x.id == ref.id)
                    for f in fields:
                        c.fields.add(f)
                        c.files[f] = str(newref.file_of(f)[0])
                assert set(fields) <= c.fields or c.quarantined
        return fine

    def _ack(self, lid: str, sids: list[int]) -> None:
        if lid not in self.leases:  # every chunk of it was quarantined and its step cleared: voided
            assert not sids
            self.b.ack(lid)
            return
        task, _holder, ids = self.leases.pop(lid)
        self.b.ack(lid)
        self.pending.pop(lid, None)
        for cid in ids:
            self.chunks[cid].consumed.add(task)
        for sid in sids:
            self.delivered[(task, sid)] += 1
            assert self.delivered[(task, sid)] == 1, f"sample {sid} delivered twice to {task}"
        self._sync()

    # ------------------------------------------------------------------------------------ rules ---

    @precondition(lambda self: self.next_step < MAX_STEPS)
    @rule()
    def start_step(self):
        s = self.next_step
        expected = satisfies(s, self.steps, self.k)
        assert self.b.may_start(s) == expected
        assert self.b.start_step(s) == expected
        event(f"gate {'open' if expected else 'shut'} (k={self.k})")
        if expected:
            self.steps[s] = {"ended": False, "chunks": []}
            self.next_step += 1

    def _open_steps(self):
        return [s for s, v in self.steps.items() if not v["ended"]]

    @precondition(lambda self: any(not v["ended"] for v in self.steps.values()))
    @rule(data=st.data(), producer=st.sampled_from(["roll-a", "roll-b"]),
          lens=st.lists(st.integers(0, 6), min_size=1, max_size=4))
    def produce(self, data, producer, lens):
        self._produce(data.draw(st.sampled_from(sorted(self._open_steps()))), producer, lens)

    @precondition(lambda self: any(not v["ended"] for v in self.steps.values()))
    @rule(producer=st.sampled_from(["roll-a", "roll-b"]), lens=st.lists(st.integers(0, 6), min_size=1, max_size=4))
    def produce_into_the_newest_step(self, producer, lens):
        self._produce(max(self._open_steps()), producer, lens)

    def _produce(self, step, producer, lens):
        sids = list(range(self.next_sid, self.next_sid + len(lens)))
        self.next_sid += len(lens)
        ref = produce(self.b, self.root, producer, step, sample_fields(sids, lens))
        self.chunks[ref.id] = MChunk(ref, sids, lens, self.order)
        self.order += 1
        self.steps[step]["chunks"].append(ref.id)

    @precondition(lambda self: any(not v["ended"] for v in self.steps.values()))
    @rule(data=st.data())
    def end_step(self, data):
        step = data.draw(st.sampled_from(sorted(self._open_steps())))
        self.b.end_step(step)
        self.steps[step]["ended"] = True
        self._sync()

    OUTCOMES = st.sampled_from(["ack", "ack", "release", "hold", "hold", "lost", "die_after_writes"])

    @rule(task=st.sampled_from(sorted(TASKS)), batch=st.integers(1, 8), data=st.data(), outcome=OUTCOMES)
    def consume(self, task, batch, data, outcome):
        self._consume(task, batch, data, outcome)

    @rule(task=st.sampled_from(sorted(TASKS)), batch=st.integers(1, 8), data=st.data(), outcome=OUTCOMES)
    def consume_more(self, task, batch, data, outcome):  # a second rule: consumers are the busiest parties
        self._consume(task, batch, data, outcome)

    def _consume(self, task, batch, data, outcome):
        holder = data.draw(st.sampled_from([h for h in HOLDERS if h.startswith(task + "-")]))
        eligible = self._eligible(task)
        expect, total = [], 0
        for c in eligible:
            if expect and total + len(c.sids) > batch:
                break
            expect.append(c.ref.id)
            total += len(c.sids)
            if total >= batch:
                break
        lease = self.b.request(task, batch_size=batch, holder=holder)
        self._sync()
        got = [] if lease is None else [r.id for r in lease.chunks]
        assert got == expect, f"{task} got {got}, the rules say {expect}"
        event(f"consume: {'a lease' if lease else 'nothing ready'}")
        if lease is None:
            return
        event(f"consume outcome: {outcome}")
        assert not set(got) & self.quarantined
        self.leases[lease.id] = (task, holder, got)
        if outcome == "lost":  # the reply never reached the consumer; only resume() finds it
            return
        sids = self._process(lease.id, task, lease.chunks)
        if outcome == "ack":
            self._ack(lease.id, sids)
        elif outcome == "release":  # False if reading voided it (all its chunks quarantined, step cleared)
            assert self.b.release(lease.id) == (lease.id in self.leases)
            self.leases.pop(lease.id, None)
        elif outcome == "hold":
            self.pending[lease.id] = sids
        else:  # the consumer dies after writing its fields, before its ack
            self._holder_died(holder)

    def _holder_died(self, holder):
        mine = sorted(lid for lid, (_, h, _) in self.leases.items() if h == holder)
        assert sorted(self.b.release_holder(holder)) == mine
        for lid in mine:
            del self.leases[lid]
            self.pending.pop(lid, None)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def ack_held(self, data):
        lid = data.draw(st.sampled_from(sorted(self.pending)))
        self._ack(lid, self.pending[lid])

    @rule(holder=st.sampled_from(HOLDERS))
    def consumer_dies(self, holder):
        self._holder_died(holder)

    @rule(holder=st.sampled_from(HOLDERS))
    def consumer_reconnects(self, holder):
        """A restarted consumer takes over its outstanding leases (whether it saw the reply or not)."""
        outstanding = self.b.outstanding(holder=holder)
        assert sorted(x.id for x in outstanding) == sorted(lid for lid, (_, h, _) in self.leases.items() if h == holder)
        if outstanding:
            event("a reconnecting consumer resumed leases")
        for lease in outstanding:
            if lease.id not in self.leases:
                continue  # finished by an earlier iteration's sync
            assert [r.id for r in lease.chunks] == self.leases[lease.id][2]
            sids = self._process(lease.id, lease.task, lease.chunks)
            self._ack(lease.id, sids)

    @rule(torn=st.booleans())
    def broker_restarts(self, torn):
        event("broker restarted")
        self.b.close()
        if torn:  # the crash hit mid-append
            with open(self.root / "journal.jsonl", "ab") as f:
                f.write(b'{"op":"leased","t":1,"lease":"L')
        self.b = self._broker()
        self._check_broker_matches_model()

    def _check_broker_matches_model(self):
        assert self.b.uncleared() == sorted(self.steps)
        want = {cid: self.chunks[cid] for s in self.steps.values() for cid in s["chunks"]}
        have = {r.id: r for r in self.b.chunks()}
        assert set(have) == set(want)
        for cid, r in have.items():
            assert set(r.all_fields) == want[cid].fields
        assert {x.id: [r.id for r in x.chunks] for x in self.b.outstanding()} == {k: v[2] for k, v in self.leases.items()}
        assert {d["chunk"] for d in self.b.damaged()} == self.quarantined

    @precondition(lambda self: not self.auto)
    @rule(data=st.data())
    def clear(self, data):
        if not self.steps:
            return
        step = data.draw(st.sampled_from(sorted(self.steps)))
        if self._complete(step):
            assert self.b.clear(step) is True
            self._forget_step(step)
        else:
            try:
                self.b.clear(step)
            except Exception as e:  # noqa: BLE001
                assert type(e).__name__ == "StepNotComplete"
            else:
                raise AssertionError(f"step {step} cleared while incomplete")

    @rule(data=st.data(), mode=st.sampled_from(["flip", "truncate"]), frac=st.floats(0, 1, exclude_max=True))
    def damage_a_file(self, data, mode, frac):
        live = [c for s in self.steps.values() for cid in s["chunks"] if not (c := self.chunks[cid]).quarantined]
        if not live:
            return
        c = data.draw(st.sampled_from(live))
        path = data.draw(st.sampled_from(sorted(set(c.files.values()))))
        size = os.path.getsize(path)
        if size == 0:
            return
        if mode == "flip":
            bump_byte(path, int(frac * size))
            c.damaged[path] = c.damaged.get(path, "flip")
        else:
            truncate(path, int(frac * size))
            c.damaged[path] = "truncate"

    # ------------------------------------------------------------------------------- invariants ---

    @invariant()
    def at_most_once(self):
        if hasattr(self, "b"):
            assert all(v == 1 for v in self.delivered.values())

    def teardown(self):
        if not hasattr(self, "b"):
            return
        try:
            self._drain()
        finally:
            self.b.close()
            shutil.rmtree(self.root, ignore_errors=True)

    def _drain(self):
        """The broker restarts, consumers come back or are declared dead, the producer ends its steps,
        consumers run dry."""
        self.broker_restarts(torn=False)
        for i, h in enumerate(HOLDERS):  # half the consumers come back and finish their leases, half are gone
            if i % 2:
                self._holder_died(h)
            else:
                self.consumer_reconnects(h)
        for s in sorted(self._open_steps()):
            self.end_step_(s)
        progress = True
        while progress:
            progress = False
            for task in ("fwd", "ref", "adv", "train"):
                while (lease := self.b.request(task, batch_size=64, holder="drain")) is not None:
                    self._sync()
                    self.leases[lease.id] = (task, "drain", [r.id for r in lease.chunks])
                    self._ack(lease.id, self._process(lease.id, task, lease.chunks))
                    progress = True
                self._sync()
        if not self.auto:
            for s in sorted(self.steps):
                assert self._complete(s)
                self.b.clear(s)
                self._forget_step(s)
        assert self.b.uncleared() == [] and not self.steps
        assert not [p for p in os.listdir(self.root) if p.startswith("step_")]
        for c in self.chunks.values():
            for task in TASKS:
                for sid in c.sids:
                    n = self.delivered[(task, sid)]
                    if not c.damaged:
                        assert n == 1, f"sample {sid} ({c.ref.id}) delivered {n} times to {task}"
                    else:
                        assert n <= 1
        result = audit(replay(self.root / "journal.jsonl"), self.k)
        assert result["violations"] == [] and result["starts"] == self.next_step
        assert result["max_lead"] <= self.k

    def end_step_(self, step):
        self.b.end_step(step)
        self.steps[step]["ended"] = True
        self._sync()


Exchange.TestCase.settings = settings(max_examples=int(os.environ.get("RELAX_XCHG_EXAMPLES", "25")),
                                      stateful_step_count=30, deadline=None)
TestExchange = Exchange.TestCase
