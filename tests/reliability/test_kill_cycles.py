"""SIGKILL fault injection: hundreds of worker processes killed at random points.

Workers are fresh interpreters (``python -m tooling.chaos_worker``, never forked),
taken from a pool of standbys started ahead of need (so a cycle does not wait for an
interpreter start; the pool counts the spawns that did), and run a random mix of calls over
prompts that share prefixes (so tree nodes are shared and locked). Each is killed either by
itself at a named point (between alloc and insert, holding locks after ``cache_unfinished``,
mid-call, mid-batch, after decode) or from outside after a random delay. About two thirds
keep their session alive with a keep-alive stream (reclaimed when it drops), the others rely
on their lease. Quarantine is on (what matters in production), so reclaiming also goes
through the pid check.

No timing decides the outcome: the lease is long (60 s of the manager's clock, so a loaded
machine never expires a live worker), and the leases of the dead are run out by the test
itself at each idle point: the manager's clock is moved forward half a lease at a time, each
move right after the survivor's lease was renewed, in one step on the manager's loop. Every
random draw is made when a victim is spawned (none when its events arrive, whose order
depends on the machine's load), so the victims and their fates are the same in every run. A
victim that is to kill itself is never killed from outside for being slow: it dies at its
point, or is killed once it says it holds (it went through its steps without reaching the
point), or at a fallback far beyond any start (``SELF_KILL_FALLBACK_S``). Waits are bounded
polls for a state, each bound generous (named below).

After every phase of cycles, at idle: every killed session is gone, invariants hold, the
conservation law holds, and a survivor worker holding requests through it all finds its
rows and KV untouched; no victim was ever handed one of its slots. At the end the tree is
evicted and every KV slot is free again: zero leaks.

``RADIXKV_KILL_CYCLES`` (default 200) sets the number of cycles; ``make soak`` runs 1,000+.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from radixkv.service.server.manager import ServeOptions
from reliability_util import (
    CHAOS_CONFIG,
    PHASE_BOUND_S,
    STATE_BOUND_S,
    Survivor,
    check_law,
    live_sessions,
    percentiles,
    wait_until,
)
from tooling.chaos import KILL_POINTS
from tooling.testing import ThreadedServer

CYCLES = int(os.environ.get("RADIXKV_KILL_CYCLES", "200"))
CONCURRENCY = 6
PHASES = 4
LEASE_S = 60.0
#: A victim that is to kill itself is killed from outside only after this long (it never
#: reached its point, and never said it holds): far beyond a start on a loaded machine.
SELF_KILL_FALLBACK_S = 90.0
#: An external kill waits this long for the victim's attach reply (then it is killed before
#: its attach reply: a case of its own).
ATTACH_WAIT_S = 1.0
#: A worker's calls: a deadline no loaded machine reaches (a DEADLINE_EXCEEDED is an error).
CALL_TIMEOUT_S = 120.0


class JumpClock:
    """``time.monotonic()`` plus an offset the test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def run_out_dead_leases(srv: ThreadedServer, clock: JumpClock, survivor: Survivor) -> None:
    """Half a lease forward, right after the survivor's lease was renewed (one step on the
    manager's loop: no sweep in between), so only the silent (dead) sessions run out."""
    def step(server) -> None:
        server.engine.heartbeat(survivor.s)
        clock.offset += LEASE_S / 2 + 0.01
    srv.call(step)


def _spec(rng: np.random.Generator, wid: int, srv: ThreadedServer) -> dict:
    self_kill = rng.random() < 0.6
    return dict(wid=wid, address=srv.address, token=srv.token, seed=int(rng.integers(1 << 30)),
                steps=int(rng.integers(3, 12)), keepalive=bool(rng.random() < 0.65), ka_interval_s=0.1,
                kill_at=str(rng.choice(KILL_POINTS)) if self_kill else None,
                kill_nth=int(rng.integers(1, 3)), hold=True, hb_interval_s=0.1, marker=float(wid + 1),
                max_life_s=600, timeout_s=CALL_TIMEOUT_S)


def test_sigkill_cycles_reclaim_everything_and_leave_survivors_alone(chaos):
    rng = np.random.default_rng(7)
    opts = ServeOptions(sweep_interval_s=0.05, grace_s=1.0, quarantine_s=10.0)
    clock = JumpClock()
    with ThreadedServer({**CHAOS_CONFIG, "lease_ttl_s": LEASE_S}, options=opts, clock=clock) as srv:
        c = srv.client()
        survivor = Survivor(c)
        base = c.stats()
        survivor_slots = set(survivor.all_locs().tolist())
        wid = 0
        killed = {}  # sid -> (kill time, keepalive)
        gone_at = {}
        victim_locs = set()
        points, errors, external, before_attach, held_instead = {}, [], 0, 0, 0
        starved_s, starved_since = 0.0, 0.0  # time a victim's place stayed empty: no standby ready
        per_phase = -(-CYCLES // PHASES)
        t_start = time.monotonic()
        for phase in range(PHASES):
            target = min(CYCLES, (phase + 1) * per_phase)
            active = {}  # wid -> [deadline, sid, keepalive]
            while wid < target or active:
                # never block on an interpreter start: a victim is started only when a
                # standby is ready, so kills and reclaim timing are never delayed by one
                while len(active) < CONCURRENCY and wid < target:
                    if not chaos.ready():
                        starved_since = starved_since or time.monotonic()
                        break
                    if starved_since:
                        starved_s += time.monotonic() - starved_since
                        starved_since = 0.0
                    spec = _spec(rng, wid, srv)
                    early, after_attach = rng.random() < 0.1, float(rng.uniform(0.0, 0.06))  # drawn now
                    chaos.spawn(spec)
                    if spec["kill_at"]:
                        fate, delay = "self", SELF_KILL_FALLBACK_S  # it kills itself (or holds: killed then)
                    elif early:
                        fate, delay = "early", float(rng.uniform(0.0, 0.05))  # during start-up / attach
                    else:
                        fate, delay = after_attach, ATTACH_WAIT_S  # re-armed when it reports its session
                    active[wid] = [time.monotonic() + delay, None, spec["keepalive"], fate]
                    wid += 1
                for ev in chaos.drain(0.005):
                    w = ev.get("wid")
                    if ev["ev"] == "attached" and w in active:
                        active[w][1] = ev["sid"]
                        if isinstance(active[w][3], float):  # an external kill: from its attach
                            active[w][0] = time.monotonic() + active[w][3]
                    elif ev["ev"] == "holding" and w in active and active[w][3] == "self":
                        active[w][0] = time.monotonic()  # through its steps without reaching its point
                    elif ev["ev"] == "alloc":
                        victim_locs.update(ev.get("locs", []))
                    elif ev["ev"] == "point" and w in active:
                        points[ev["name"]] = points.get(ev["name"], 0) + 1
                        active[w][0] = -1.0  # it killed itself: collect it now
                    elif ev["ev"] == "error":
                        errors.append(ev)
                now = time.monotonic()
                for w in [w for w, a in active.items() if a[0] <= now]:
                    deadline, sid, ka, fate = active.pop(w)
                    chaos.kill(w)
                    external += deadline >= 0
                    held_instead += fate == "self" and deadline >= 0
                    if sid is not None:
                        killed[sid] = (time.monotonic(), ka)
                    else:
                        before_attach += 1  # its session, if the manager made one, must go too
                for sid in set(killed) - set(gone_at) - live_sessions(srv):
                    gone_at[sid] = time.monotonic()
            # idle point: every killed session reclaimed, only the survivor left
            def all_gone():
                run_out_dead_leases(srv, clock, survivor)
                live = live_sessions(srv)
                for sid in set(killed) - set(gone_at) - live:
                    gone_at[sid] = time.monotonic()
                return len(live) == 1
            assert wait_until(all_gone, PHASE_BOUND_S, every_s=0.05), \
                f"phase {phase}: sessions left {live_sessions(srv)}"
            srv.call(lambda s: s.servicer.check_all())
            st = c.stats()
            check_law(st)
            assert (st.requests, st.kv_held, st.kv_protected, st.rows_available) == \
                (base.requests, base.kv_held, base.kv_protected, base.rows_available), (phase, st, base)
            survivor.check_untouched()
            chaos.check_invariants()
        elapsed = time.monotonic() - t_start
        assert not errors, errors[:5]
        assert wid == CYCLES and len(killed) + before_attach == CYCLES, (wid, len(killed), before_attach)
        assert len(killed) >= CYCLES // 2
        assert not (victim_locs & survivor_slots), "a victim was handed one of the survivor's slots"
        assert set(points) == set(KILL_POINTS), points  # every kill point was exercised
        assert set(killed) <= set(gone_at)
        survivor.finish()
        idle = wait_until(lambda: (lambda s: s if s.sessions == 0 else None)(c.stats()), STATE_BOUND_S)
        assert idle is not None
        assert idle.kv_held == 0 and idle.kv_protected == 0 and idle.requests == 0
        assert idle.rows_available == idle.rows_capacity
        check_law(idle)
        s = c.attach("auditor").session
        c.evict(s, idle.kv_capacity)
        c.detach(s)
        final = c.stats()
        assert final.kv_available == final.kv_capacity, f"leaked KV slots: {final}"
        srv.call(lambda s: s.servicer.check_all())
        q = srv.call(lambda s: s.servicer.quarantine.stats())
        lat_ka = [gone_at[s] - t for s, (t, ka) in killed.items() if ka]
        lat_lease = [gone_at[s] - t for s, (t, ka) in killed.items() if not ka]
        print("RELIABILITY kill_cycles " + json.dumps({
            "cycles": wid, "sessions_killed": len(killed), "killed_before_attach_reply": before_attach,
            "killed_from_outside": external, "self_killers_that_held_instead": held_instead,
            "self_kills_by_point": points, "elapsed_s": round(elapsed, 1),
            "reclaim_latency_ms_keepalive": percentiles(lat_ka),
            "reclaim_latency_ms_lease_at_idle_point": percentiles(lat_lease),
            "quarantine": q._asdict(), "victim_slots_seen": len(victim_locs),
            "standby_pool": chaos.stats()._asdict(), "no_standby_ready_s": round(starved_s, 2)}))
