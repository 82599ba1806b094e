"""Collection over env.net: a `TelemetryServer` in each rank process serves its ranks' summaries; a
`Collector` (run beside the lighthouse) learns the servers when they register, pulls every one on
demand, assembles the job's Snapshot and Layout (`assemble`, pure), runs the analysis and the eviction
rule, and answers `ftrun diagnose`.

Protocol (framed msgpack, never pickle; every request carries the job token):
  server <- {"type": "pull", "token"}
      -> {"type": "telemetry", "now", "serve_s", "ranks": [{"key", "summary", "hist", "written"}]}
  collector <- {"type": "register", "token", "addr", "ranks": [{"key", "replica", "rank", "host", "incarnation"}]}
      -> {"type": "ok"}
  collector <- {"type": "verdict", "token"}   -> {"type": "verdict", ...verdict_dict}
"summary" and "hist" are the raw bytes of one SUMMARY row and HIST_LEN HIST rows (fixed dtypes, checked).
A malformed request is refused whole, naming its field; a malformed reply leaves that server's ranks unanswered.
A server that does not answer within pull_timeout_s leaves its ranks unanswered: a hung (SIGSTOPped) or
dead process is exactly what the analysis looks for. Rank clocks are mapped onto the collector's with the
offset of each reply (collector now - rank now), so hosts need no common clock.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ftrun.diagnose.act import EvictionConfig, Sighting, decide_eviction, sight, silent_culprits
from ftrun.diagnose.analysis import analyze
from ftrun.diagnose.model import AnalysisConfig, Layout, Snapshot, Verdict
from ftrun.diagnose.summary import HIST, HIST_LEN, SUMMARY, empty_hist, empty_summary, summarize
from ftrun.diagnose.telemetry import Ev, Op, Recorder
from ftrun.env.base import Connection, Env, NetError, PeerClosed, Task, serve_connections
from ftrun.net import require_token, token_matches

log = logging.getLogger("ftrun.diagnose")

_TIMES_S = ("now", "f_enter", "f_last", "t_t", "q_t", "c_t")
_TIMES_H = ("enter", "done")


class DiagnoseError(Exception):
    """A diagnosis request failed: refused (token, bad message) or unanswered."""


class DiagnoseClosed(DiagnoseError):
    """The peer closed the connection before replying: in a burst of connections a listener closes those beyond
    its caps unread (ftrun.env.admission), so `TelemetryServer.register` tries again."""


REGISTER_RETRY_S = (0.05, 1.0)  # a registration's first wait before trying again, and the longest one


@dataclass(frozen=True)
class RankInfo:
    key: str  # unique, e.g. "r3/5"
    replica: int  # replica index
    rank: int  # group rank within the replica (its FTAR ring)
    host: str
    incarnation: int = 0  # the replica's incarnation the rank belongs to (a restart registers anew)


MAX_INDEX = 1 << 20  # the replica and rank indices a register may carry (the analysis sizes arrays by the largest)


def parse_register(msg: dict) -> tuple[str, list[RankInfo]]:
    """The server address and ranks of a register request (pure). ValueError naming the first malformed
    field: nothing of such a request is registered (an index out of range broke every later diagnosis)."""
    addr, ranks = msg.get("addr"), msg.get("ranks")
    if not isinstance(addr, str) or not addr:
        raise ValueError(f"register needs the server's address in 'addr', got {addr!r:.80}")
    if not isinstance(ranks, list):
        raise ValueError(f"register needs a list in 'ranks', got {type(ranks).__name__}")
    infos = []
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or not isinstance(r.get("key"), str) or not r["key"] or \
                not isinstance(r.get("host"), str):
            raise ValueError(f"register: ranks[{i}] needs a non-empty string 'key' and a string 'host'")
        infos.append(RankInfo(r["key"], _index(r, i, "replica", MAX_INDEX), _index(r, i, "rank", MAX_INDEX), r["host"],
                              _index(r, i, "incarnation", 2**62, default=0)))
    return addr, infos


def _index(entry: dict, i: int, name: str, limit: int, default: int | None = None) -> int:
    value = entry.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise ValueError(f"register: ranks[{i}] needs an integer in [0, {limit}) in {name!r}, got {value!r:.80}")
    return value


def _check_token(msg: dict, token: str) -> None:
    got = msg.get("token")
    if not token_matches(got, token):
        raise DiagnoseError("wrong job token")


def request(env: Env, addr: str, msg: dict, timeout: float, *, cancelled: Callable[[], bool] | None = None,
            opened: Callable[[Connection], None] | None = None) -> dict:
    """One request/reply; raises DiagnoseError on refusal or when no reply comes within `timeout`.
    `cancelled`: the connect's (it gives up once that is true); `opened(conn)`: called with the connection once
    it is made, e.g. so another task can close it to end the request at once."""
    try:
        conn = env.net.connect(addr, timeout=timeout, cancelled=cancelled)
    except NetError as e:
        raise DiagnoseError(f"cannot reach {addr}: {e}") from e
    try:
        if opened is not None:
            opened(conn)
        conn.send(msg, timeout=timeout)
        reply = conn.recv(timeout=timeout)
    except PeerClosed as e:
        raise DiagnoseClosed(f"{addr} closed the connection before answering {msg.get('type')!r}: {e}") from e
    except NetError as e:
        raise DiagnoseError(f"{addr} did not answer {msg.get('type')!r} within {timeout}s: {e}") from e
    finally:
        conn.close()
    if reply.get("type") == "error":
        raise DiagnoseError(f"{addr} refused: {reply.get('error')}")
    return reply


class _Service:
    """Accept loop + one short-lived handler per connection (one request, one reply)."""

    def __init__(self, env: Env, token: str, bind: str, name: str) -> None:
        self.env, self._bind, self._name = env, bind, name
        self._token = require_token(token, f"the diagnose {name} service")
        self.addr = ""
        self._listener = None
        self._task = None

    def start(self) -> str:
        self._listener = self.env.net.listen(self._bind)
        self.addr = self._listener.addr
        self._task = serve_connections(self.env, self._listener, self._handle, name=f"{self._name}-accept",
                                       conn_name=f"{self._name}-conn")
        return self.addr

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._task is not None:
            self._task.join(timeout=5.0)

    def _handle(self, conn: Connection) -> None:
        try:
            try:
                msg = conn.recv(timeout=5.0)
                _check_token(msg, self._token)
                reply = self.answer(msg)
            except DiagnoseError as e:
                reply = {"type": "error", "error": str(e)}
            except (NetError, ValueError, KeyError, TypeError) as e:
                reply = {"type": "error", "error": f"bad request: {type(e).__name__}: {e}"}
            conn.send(reply, timeout=5.0)
        except NetError:
            pass
        finally:  # also after an error answer() did not expect: the client learns at once, not at its timeout
            conn.close()

    def answer(self, msg: dict) -> dict:
        raise NotImplementedError


SUMMARY_TAIL = 256  # newest records summarize_recorder reads first (x4 until they hold what summarize reads)
_FTAR, _TREE, _QUORUM, _CATCHUP, _ENTER, _DONE = map(int, (Op.FTAR, Op.TREE, Op.QUORUM, Op.CATCHUP, Ev.ENTER, Ev.DONE))


def summarize_recorder(rec: Recorder, now: float) -> tuple[np.ndarray, np.ndarray]:
    """One rank's (SUMMARY row, HIST rows) now: what a TelemetryServer answers for it by default.
    Exactly `summarize(rec.records(), now)`, from the newest records: the first SUMMARY_TAIL, four times more
    while they lack the all-reduces summarize reads, then only from where it reads (`summary_start`), with the
    last TREE / QUORUM / CATCHUP record the tail lacks (an old catch-up) taken alone. A pull costs what the
    rank did lately, not its whole buffer (25,000 records once full: ~90 ms a rank, the bench's growth with
    its history)."""
    n, held = SUMMARY_TAIL, rec.held
    while True:
        tail = rec.records(last=n)
        start = summary_start(tail, rec.holds(_FTAR) if n < held else False)
        if start is not None:
            break
        n *= 4
    tail = tail[start:]
    older = [rec.last_record(op) for op in (_TREE, _QUORUM, _CATCHUP) if not (tail["op"] == op).any()]
    older = [r for r in older if r is not None]
    return summarize(np.concatenate([*older, tail]) if older else tail, now)


def summary_start(tail: np.ndarray, older_ftar: bool) -> int | None:
    """Where in a buffer's newest records `tail` begins what `summarize` reads of them, None if the buffer's
    older records (`older_ftar`: they may hold an FTAR ENTER) are needed too (pure). summarize reads the last
    TREE, QUORUM and CATCHUP record, the FTAR records from the last ENTER (the current all-reduce) and the
    last HIST_LEN all-reduces with a DONE, each from its ENTER to the next: HIST_LEN of them starting in the
    tail are the buffer's last ones (a record before the tail's first ENTER belongs to an older one)."""
    ops = tail["op"]
    firsts = []
    for op in (_TREE, _QUORUM, _CATCHUP):
        at = np.flatnonzero(ops == op)
        if at.size:
            firsts.append(int(at[-1]))
    ftar = np.flatnonzero(ops == _FTAR)
    ev = tail["ev"][ftar]
    enters = np.flatnonzero(ev == _ENTER)
    if enters.size:
        finished = np.flatnonzero(np.add.reduceat(ev == _DONE, enters) > 0)
        if len(finished) < HIST_LEN and older_ftar:
            return None
        firsts.append(int(ftar[enters[finished[-HIST_LEN]] if len(finished) >= HIST_LEN else enters[0]]))
    elif older_ftar:
        return None
    return min(firsts, default=len(tail))


class TelemetryServer(_Service):
    """Serves the summaries of the ranks of one process. `ranks`: RankInfo -> that rank's Recorder;
    `summaries(recorder, now)`: its (SUMMARY row, HIST rows), by default `summarize_recorder` (a driver
    serving many ranks from few recorders may pass a cache of it). `registered` is set once the collector
    has accepted the registration."""

    def __init__(self, *, env: Env, token: str, ranks: dict[RankInfo, Recorder], bind: str = "127.0.0.1:0",
                 summaries: Callable[[Recorder, float], tuple[np.ndarray, np.ndarray]] = summarize_recorder) -> None:
        super().__init__(env, token, bind, "telemetry")
        self.ranks, self._summaries = ranks, summaries
        self.serve_s = 0.0  # time spent answering pulls (summarizing), the collection's cost on this process
        self.registered = env.event()
        self._stopping = env.event()  # stop(): a registration in flight ends
        self._register_conn: Connection | None = None  # the connection of the registration in flight
        self.registration: Task | None = None  # register_in_background's task

    def register(self, collector: str, timeout: float = 5.0) -> None:
        """Register with the collector. A registration whose connection the collector closed unanswered is
        tried again (backing off, REGISTER_RETRY_S) until `timeout`: every rank of a job registers as it
        starts, and a listener closes connections beyond its cap on those not past their first message
        (ftrun.env.admission), so in a large job's burst some are closed unread. Anything else is raised as
        before: a refusal at once, a collector nobody listens at once connect gives up (it waits for a
        listener until `timeout`), a reply that did not come within it. `stop()` ends it at once (DiagnoseError
        saying so). A rank registers in the background (`register_in_background`): its build does not wait."""
        ranks = [{"key": i.key, "replica": i.replica, "rank": i.rank, "host": i.host, "incarnation": i.incarnation}
                 for i in self.ranks]
        msg = {"type": "register", "token": self._token, "addr": self.addr, "ranks": ranks}
        deadline, wait = self.env.clock.now() + timeout, REGISTER_RETRY_S[0]
        while True:
            try:
                request(self.env, collector, msg, max(deadline - self.env.clock.now(), 1e-3),
                        cancelled=self._stopping.is_set, opened=self._opened)
                self.registered.set()
                return
            except DiagnoseError as e:
                if self._stopping.is_set():
                    raise DiagnoseError(f"registration with {collector} cancelled: the server stopped") from e
                if not isinstance(e, DiagnoseClosed) or self.env.clock.now() + wait >= deadline:
                    raise
            finally:
                self._register_conn = None
            if self._stopping.wait(timeout=wait):
                raise DiagnoseError(f"registration with {collector} cancelled: the server stopped")
            wait = min(2 * wait, REGISTER_RETRY_S[1])

    def _opened(self, conn: Connection) -> None:
        self._register_conn = conn
        if self._stopping.is_set():  # stop() may have looked for a connection before this one was made
            conn.close()

    def register_in_background(self, collector: str, timeout: float = 5.0) -> Task:
        """`register` as a task of its own: the caller goes on at once (a rank trains while it registers).
        A registration that fails is logged once, a warning naming the collector and why, and not raised:
        diagnosis is an aid, training does not depend on it. `stop()` cancels it and waits for it."""
        def body() -> None:
            try:
                self.register(collector, timeout)
            except DiagnoseError as e:
                if not self._stopping.is_set():
                    log.warning("telemetry of %s not registered with the diagnosis collector %s: %s",
                                ", ".join(i.key for i in self.ranks), collector, e)

        self.registration = self.env.spawn(body, name="telemetry-register")
        return self.registration

    def stop(self) -> None:
        """Stop serving; a registration in flight is cancelled (its connection closed) and waited for."""
        self._stopping.set()
        conn = self._register_conn
        if conn is not None:
            conn.close()
        if self.registration is not None:
            self.registration.join(timeout=5.0)
        super().stop()

    def answer(self, msg: dict) -> dict:
        if msg.get("type") != "pull":
            raise DiagnoseError(f"unknown request {msg.get('type')!r}")
        now = self.env.clock.now()
        out = []
        for info, rec in self.ranks.items():
            s, h = self._summaries(rec, now)
            out.append({"key": info.key, "summary": s.tobytes(), "hist": h.tobytes(), "written": rec.written})
        self.serve_s += self.env.clock.now() - now
        return {"type": "telemetry", "now": now, "ranks": out, "serve_s": self.serve_s}


def reply_fields(reply: dict) -> tuple[float, float, int, list]:
    """(its clock's now, serve_s, records written, rank entries) of a server's pull reply (pure); ValueError
    naming what is malformed (the entries are checked one by one, by `rank_bytes`)."""
    now, serve_s, rows = reply.get("now"), reply.get("serve_s", 0.0), reply.get("ranks", [])
    for name, value in (("now", now), ("serve_s", serve_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"the reply's {name!r} must be a finite number, got {value!r:.80}")
    if not isinstance(rows, list):
        raise ValueError(f"the reply's 'ranks' must be a list, got {type(rows).__name__}")
    written = [row.get("written", 0) for row in rows if isinstance(row, dict)]
    if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in written):
        raise ValueError("the reply's 'written' counts must be non-negative integers")
    return now, float(serve_s), sum(written), rows


def rank_bytes(row: dict) -> tuple[str, bytes, bytes]:
    """(key, SUMMARY row bytes, HIST rows bytes) from one reply entry; ValueError if the bytes do not fit."""
    if not isinstance(row, dict):
        raise ValueError(f"a telemetry entry must be a map, got {type(row).__name__}")
    key, s, h = row.get("key"), row.get("summary"), row.get("hist")
    if not isinstance(key, str) or not isinstance(s, bytes) or not isinstance(h, bytes):
        raise ValueError("a telemetry entry needs str key and bytes summary and hist")
    if len(s) != SUMMARY.itemsize or len(h) != HIST_LEN * HIST.itemsize:
        raise ValueError(f"telemetry of {key}: {len(s)}/{len(h)} bytes, expected {SUMMARY.itemsize}/"
                         f"{HIST_LEN * HIST.itemsize}")
    return key, s, h


def parse_rank(row: dict) -> tuple[str, np.ndarray, np.ndarray]:
    """(key, SUMMARY row, HIST rows) from one reply entry; ValueError if the bytes do not fit."""
    key, s, h = rank_bytes(row)
    return key, np.frombuffer(s, SUMMARY).copy(), np.frombuffer(h, HIST).copy()


@dataclass
class _Known:
    info: RankInfo
    addr: str
    summary: np.ndarray = field(default_factory=empty_summary)  # last seen, on the collector's clock
    hist: np.ndarray = field(default_factory=empty_hist)
    seen: bool = False


def assemble(known: list[_Known], answered_keys: set[str], now: float) -> tuple[Snapshot, Layout]:
    """The analysis input from what each rank last sent (pure). The ring position of a rank is its ring
    index in the newest epoch (quorum) it was seen in; a rank last seen in an older one is outside it, unless
    it did not answer and its replica holds a position in the newest epoch: then it holds that position (a
    replica's ranks share its ring index), so a hung rank last pulled before the quorum moved on is still
    the one its ring waits on."""
    hosts = sorted({k.info.host for k in known})
    host_index = {h: i for i, h in enumerate(hosts)}
    # one join of the rows' bytes: concatenating 98K one-row structured arrays costs seconds
    s = np.frombuffer(b"".join([k.summary.tobytes() for k in known]), SUMMARY).copy()
    h = np.frombuffer(b"".join([k.hist.tobytes() for k in known]), HIST).reshape(-1, HIST_LEN).copy()
    newest = s["f_qid"].max() if len(s) else -1
    ring_pos = np.where((s["f_qid"] == newest) & (newest >= 0), s["f_index"], -1).astype(np.int64)
    replica = np.array([k.info.replica for k in known], np.int64)
    answered = np.array([k.info.key in answered_keys for k in known], bool)
    ring_size = 0
    if len(s) and (ring_pos >= 0).any():  # a silent rank last seen in an older epoch (a hung rank not pulled
        rep_pos = np.full(int(replica.max()) + 1, -1, np.int64)  # since the quorum moved on) holds its
        held = ring_pos >= 0  # replica's ring position: every rank of a replica has the replica's ring index
        rep_pos[replica[held]] = ring_pos[held]
        fill = (ring_pos < 0) & ~answered & (rep_pos[replica] >= 0)
        ring_pos[fill] = rep_pos[replica[fill]]
        ring_size = int(s["f_ring"][held].max())
        _place_silent_replicas(ring_pos, rep_pos, replica, answered, s["f_index"], ring_size)
    layout = Layout(replica=replica,
                    group=np.array([k.info.rank for k in known], np.int64),
                    host=np.array([host_index[k.info.host] for k in known], np.int64),
                    ring_pos=ring_pos, host_names=tuple(hosts), ring_size=ring_size)
    return Snapshot(now=now, answered=answered, summary=s, hist=h), layout


def _place_silent_replicas(ring_pos: np.ndarray, rep_pos: np.ndarray, replica: np.ndarray, answered: np.ndarray,
                           last_index: np.ndarray, ring_size: int) -> None:
    """Replicas none of whose ranks answered and that hold no position in the newest ring (they went silent
    before they were pulled in this epoch) take the positions no answering rank holds (in place): one
    replica for one free position; several when their last seen ring indices are exactly the free ones."""
    free = np.setdiff1d(np.arange(ring_size), rep_pos[rep_pos >= 0])
    heard = np.zeros(len(rep_pos), bool)
    heard[replica[answered]] = True
    silent = np.flatnonzero((rep_pos < 0) & ~heard)
    silent = silent[np.isin(silent, replica)]
    if not free.size or free.size != silent.size:
        return
    if free.size == 1:
        ring_pos[(replica == silent[0]) & (ring_pos < 0)] = free[0]
        return
    last = [np.unique(last_index[replica == r]) for r in silent]
    if all(x.size == 1 for x in last) and sorted(int(x[0]) for x in last) == free.tolist():
        for r, x in zip(silent, last):
            ring_pos[(replica == r) & (ring_pos < 0)] = int(x[0])


def verdict_dict(v: Verdict, layout: Layout, keys: list[str]) -> dict:
    return {"kind": v.kind, "reason": v.reason, "ranks": [keys[r] for r in v.ranks],
            "rank_names": [layout.rank_name(r) for r in v.ranks[:16]],
            "hosts": [layout.host_name(x) for x in v.hosts], "replicas": list(v.replicas),
            "collectives": list(v.collectives), "lag_s": v.lag_s, "edges": display_edges(v, layout)}


def display_edges(v: Verdict, layout: Layout, limit: int = 16) -> list[list[str]]:
    """The verdict's collective wait-for edges, and from the blocked collective each culprit is in (its FTAR
    ring, else its replica's tree collective, else every blocked collective) to the culprit's rank name:
    the graph the status page and the reports draw (ftrun.diagnose.graph)."""
    edges = [[a, b] for a, b in v.edges]
    for r in v.ranks[:limit]:
        name = layout.rank_name(r)
        ring = f"ftar ring {int(layout.group[r])}"
        tree = [c for c in v.collectives if c.startswith("tree collective") and
                c.endswith(f" of replica {int(layout.replica[r])}")]
        edges += [[c, name] for c in ([ring] if ring in v.collectives else tree or list(v.collectives))]
    return edges


@dataclass(frozen=True, kw_only=True)
class CollectorConfig:
    pull_timeout_s: float = 1.0
    analysis: AnalysisConfig = AnalysisConfig()
    eviction: EvictionConfig = EvictionConfig()

    def __post_init__(self) -> None:
        if self.pull_timeout_s <= 0:
            raise ValueError(f"CollectorConfig.pull_timeout_s must be > 0, got {self.pull_timeout_s}")


class Collector(_Service):
    """Beside the lighthouse: registered telemetry servers, pulled on each `diagnose()`."""

    def __init__(self, *, env: Env, token: str, bind: str = "127.0.0.1:0",
                 config: CollectorConfig = CollectorConfig()) -> None:
        super().__init__(env, token, bind, "collector")
        self.config = config
        self._known: dict[str, _Known] = {}
        self._lock, self._diagnosing = env.lock(), env.lock()  # the rank table; one diagnosis at a time
        self._last: Sighting | None = None  # the previous pull's verdict, silent culprits and first sighting
        self.latest: dict | None = None
        self.last_input: tuple[Snapshot, Layout] | None = None  # the latest analysis input
        self.last_analysis_s = 0.0  # seconds the latest analysis took (the pure function alone), by `timer`
        self.timer = env.clock.now  # a driver may set a real-time counter (the emulator's clock stands still)
        self.cost: dict[str, dict] = {}  # server address -> {"serve_s", "written"} as last reported

    def answer(self, msg: dict) -> dict:
        kind = msg.get("type")
        if kind == "register":
            addr, ranks = parse_register(msg)
            with self._lock:
                for info in ranks:
                    self._known[info.key] = _Known(info, addr)
            return {"type": "ok"}
        if kind == "verdict":
            return {"type": "verdict", **self.diagnose()}
        raise DiagnoseError(f"unknown request {kind!r}")

    def diagnose(self) -> dict:
        """Pull every server, analyze, decide; the verdict as a dict (with `eviction` and counts)."""
        with self._diagnosing:
            return self._diagnose()

    def _diagnose(self) -> dict:
        with self._lock:
            known = sorted(self._known.values(), key=lambda k: (k.info.replica, k.info.rank))
        answered = self._pull({k.addr for k in known})
        now = self.env.clock.now()
        snap, layout = assemble(known, answered, now)
        w0 = self.timer()
        verdict = analyze(snap, layout, self.config.analysis)
        self.last_analysis_s = self.timer() - w0
        self.last_input = (snap, layout)
        live = len({k.info.replica for k in known})
        silent = silent_culprits(verdict, snap.answered, layout.replica)
        self._last = sight(self._last, verdict, silent, now)
        first = self._last.first_seen
        eviction = decide_eviction(now, verdict, first, max(live, 1), self.config.eviction, silent=silent,
                                   replica_of=layout.replica)
        out = verdict_dict(verdict, layout, [k.info.key for k in known])
        incarnation: dict[int, int] = {}  # the silent culprits' (else the culprits') oldest incarnation:
        replica_id: dict[int, str] = {}  # a dead incarnation's restart is never the one evicted
        for r in silent or verdict.ranks:
            info = known[r].info
            incarnation[info.replica] = min(incarnation.get(info.replica, info.incarnation), info.incarnation)
            replica_id[info.replica] = info.key.rsplit("/", 1)[0]
        out.update(silent=[known[r].info.key for r in silent],
                   eviction={"replicas": list(eviction.replicas), "reason": eviction.reason,
                             "incarnations": [incarnation.get(r, -1) for r in eviction.replicas],
                             "replica_ids": [replica_id.get(r, f"r{r}") for r in eviction.replicas],
                             "retry_at": eviction.retry_at},
                   num_ranks=len(known), num_answered=len(answered), t=now)
        return out

    def run_every(self, interval_s: float, stop) -> None:
        """Diagnose every `interval_s` until the event `stop` is set (run it as a task); keeps `latest`."""
        while not stop.wait(timeout=interval_s):
            try:
                self.latest = self.diagnose()
            except Exception:  # a monitor outlives one bad round; the error is logged with its traceback
                log.exception("diagnosis round failed")

    def _pull(self, addrs: set[str]) -> set[str]:
        """Pull every server at once; the keys of the ranks that answered (their state updated)."""
        results: dict[str, tuple[float, float, int, list]] = {}
        timeout = self.config.pull_timeout_s

        def pull(addr: str) -> None:
            try:
                results[addr] = reply_fields(request(self.env, addr, {"type": "pull", "token": self._token}, timeout))
            except DiagnoseError as e:
                log.info("no telemetry from %s: %s", addr, e)
            except ValueError as e:  # its ranks stay unanswered, as if it had not answered
                log.warning("dropping the telemetry of %s: %s", addr, e)

        tasks = [self.env.spawn(pull, a, name="collector-pull") for a in sorted(addrs)]
        for t in tasks:
            t.join(timeout=timeout + 1.0)
        arrived = self.env.clock.now()
        keys: list[str] = []
        rows_s: list[bytes] = []
        rows_h: list[bytes] = []
        offsets: list[float] = []
        for addr, (now, serve_s, written, rows) in list(results.items()):
            self.cost[addr] = {"serve_s": serve_s, "written": written}
            offset = arrived - now
            for row in rows:
                try:
                    key, s, h = rank_bytes(row)
                except ValueError as e:
                    log.warning("dropping telemetry: %s", e)
                    continue
                keys.append(key)
                rows_s.append(s)
                rows_h.append(h)
                offsets.append(offset)
        return self._store(keys, rows_s, rows_h, np.array(offsets, np.float64))

    def _store(self, keys: list[str], rows_s: list[bytes], rows_h: list[bytes], offsets: np.ndarray) -> set[str]:
        """Keep each known rank's rows, their times mapped onto the collector's clock (whole columns at once:
        field by field per row costs seconds at 98K ranks); the keys stored."""
        s = np.frombuffer(b"".join(rows_s), SUMMARY).copy()
        h = np.frombuffer(b"".join(rows_h), HIST).reshape(-1, HIST_LEN).copy()
        for f in _TIMES_S:
            s[f] += offsets
        for f in _TIMES_H:
            h[f] += offsets[:, None]
        answered: set[str] = set()
        with self._lock:
            for i, key in enumerate(keys):
                k = self._known.get(key)
                if k is not None:
                    k.summary, k.hist, k.seen = s[i:i + 1], h[i], True
                    answered.add(key)
        return answered
