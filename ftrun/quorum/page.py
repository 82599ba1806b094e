"""The lighthouse status page: what a team looks at during an incident (pure: dicts in, HTML out).

    render(status, history, diagnosis, now) -> str

One self-contained HTML page (inline CSS and SVG, no script, nothing fetched from elsewhere) that reloads
itself every REFRESH_S seconds: the job's current step and quorum; each replica and its phase
(`replica_rows`); the recent quorums with their joiners and leavers (`quorum_rows`); and the diagnosis
monitor's verdict (ftrun.diagnose.monitor: `Monitor.report()`) with its wait-for graph drawn
(ftrun.diagnose.graph), its recent changes and the evictions it made. Every value that comes from a replica
or a verdict is escaped; the job token is never an input.
"""

from __future__ import annotations

from html import escape
from typing import Any, Iterable

from ftrun.diagnose import graph

REFRESH_S = 2
QUORUMS_SHOWN = 12
VERDICTS_SHOWN = 10
VERDICT_COLOR = {"no_hang": "#2ca02c", "hang": graph.CULPRIT_FILL, "candidates": graph.CANDIDATE_FILL,
                 "slow_host": "#d98b00", "slow_rank": "#d98b00", "slow_link": "#d98b00"}
_MEMBER_EVENTS = ("member_joined", "member_lost", "member_evicted", "told_finished")

CSS = """body{font-family:sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #bbb;padding:3px 8px;text-align:left}
th{background:#f0f0f0}tr.suspect td{background:#fde0dc}.muted{color:#777}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:bold}
.phase-training{color:#2a7a2a}.phase-lost,.phase-evicted{color:#b00;font-weight:bold}
.phase-waiting,.phase-healing,.phase-reconnecting{color:#8a6d00}.summary span{margin-right:18px}"""


def _culprit_replicas(verdict: dict | None) -> set[str]:
    """Replica ids of a hang verdict's culprits ("r1/0" -> "r1")."""
    if not verdict or verdict.get("kind") not in ("hang", "candidates"):
        return set()
    keys = [str(k) for k in (verdict.get("silent") or []) + (verdict.get("ranks") or [])]
    return {k.rsplit("/", 1)[0] for k in keys if "/" in k}


def replica_rows(status: dict, history: Iterable[dict], verdict: dict | None = None) -> list[dict[str, Any]]:
    """One row per replica the lighthouse knows: its phase (training, healing: catching up in the latest
    quorum, waiting for a quorum, joining, reconnecting: expected back by a restarted lighthouse, lost,
    evicted, finished), whether it is connected, when it was last heard, the step it asks for, and whether
    the latest verdict names it."""
    last: dict[str, dict] = {}
    behind: set[str] = set()  # healed (caught up from a peer) in the latest quorum
    for h in history:
        if h.get("event") in _MEMBER_EVENTS and "replica_id" in h:
            last[h["replica_id"]] = h
        elif h.get("event") == "quorum":
            behind = {str(b) for b in h.get("behind", [])}
    asks = status.get("asks", {})
    pending = set(status.get("pending", []))
    participants = set(status.get("participants", []))
    suspects = _culprit_replicas(verdict)
    rows = []
    for rid, m in sorted(status.get("members", {}).items()):
        event, phase_detail = last.get(rid, {}), ""
        if event.get("event") == "told_finished":
            phase = "finished"
        elif m.get("expected") and not m.get("connected"):
            phase = "reconnecting"
        elif not m.get("connected"):
            phase = "evicted" if event.get("event") == "member_evicted" else "lost"
            why = event.get("why")
            phase_detail = f"{phase} ({why})" if why else phase
        elif rid in pending:
            phase = "waiting"
        elif rid in participants:
            phase = "healing" if rid in behind else "training"
        else:
            phase = "joining"
        detail = {"waiting": f"waiting for a quorum (step {asks[rid]})" if rid in asks else "waiting for a quorum",
                  "training": "training", "joining": "joining", "finished": "finished",
                  "reconnecting": "expected back (the lighthouse restarted)",
                  "healing": f"catching up to step {status.get('max_step')} from a peer"}.get(phase)
        rows.append({"replica_id": rid, "phase": phase, "detail": detail or phase_detail,
                     "connected": bool(m.get("connected")), "heard_s_ago": m.get("heard_s_ago"),
                     "in_quorum": rid in participants, "asks_step": asks.get(rid), "suspect": rid in suspects})
    return rows


def quorum_rows(history: Iterable[dict], limit: int = QUORUMS_SHOWN) -> list[dict[str, Any]]:
    """The last `limit` quorums, newest first: id, steps, participants, joiners and leavers (against the
    quorum before it), replicas behind (healed) and left out. The fast path hands out the same quorum id
    step after step: consecutive hand-outs of one id and membership are one row (`step`: its first,
    `last_step`: its latest; `behind`: any replica healed in it)."""
    rows: list[dict[str, Any]] = []
    prev = None
    for h in history:
        if h.get("event") != "quorum":
            continue
        parts = [str(p) for p in h.get("participants", [])]
        behind = [str(b) for b in h.get("behind", [])]
        top = rows[-1] if rows else None
        if top is not None and top["quorum_id"] == h.get("quorum_id") and top["participants"] == parts \
                and not h.get("rewind"):
            top.update(t=h.get("t"), last_step=h.get("max_step"), hand_outs=top["hand_outs"] + 1)
            top["behind"] += [b for b in behind if b not in top["behind"]]
            continue
        rows.append({"t": h.get("t"), "quorum_id": h.get("quorum_id"), "step": h.get("max_step"),
                     "last_step": h.get("max_step"), "hand_outs": 1, "participants": parts,
                     "joiners": [p for p in parts if prev is not None and p not in prev],
                     "left": [p for p in (prev or []) if p not in parts], "behind": behind,
                     "left_out": [str(b) for b in h.get("left_out", [])], "rewind": bool(h.get("rewind"))})
        prev = parts
    return rows[::-1][:limit]


def _e(x: Any) -> str:
    return escape(str(x))


def _ago(now: float, t: Any) -> str:
    return f"{now - float(t):.1f}s ago" if isinstance(t, (int, float)) else ""


def _names(xs: list[str]) -> str:
    return _e(", ".join(xs)) if xs else '<span class="muted">-</span>'


def _replicas_html(rows: list[dict]) -> str:
    if not rows:
        return '<p class="muted">no replica has connected yet</p>'
    body = "".join(
        f'<tr class="{"suspect" if r["suspect"] else ""}"><td>{_e(r["replica_id"])}</td>'
        f'<td class="phase-{_e(r["phase"])}">{_e(r["detail"])}</td><td>{"yes" if r["connected"] else "no"}</td>'
        f'<td>{_e(r["heard_s_ago"])}</td><td>{"yes" if r["in_quorum"] else ""}</td>'
        f'<td>{"named by the diagnosis" if r["suspect"] else ""}</td></tr>' for r in rows)
    return ("<table id=replicas><tr><th>replica</th><th>phase</th><th>connected</th><th>heard (s ago)</th>"
            f"<th>in quorum</th><th>diagnosis</th></tr>{body}</table>")


def _steps(q: dict) -> str:
    return str(q["step"]) if q["last_step"] == q["step"] else f"{q['step']}\u2013{q['last_step']}"


def _quorums_html(rows: list[dict], now: float) -> str:
    if not rows:
        return '<p class="muted">no quorum yet</p>'
    body = "".join(
        f'<tr><td>{_e(q["quorum_id"])}</td><td>{_e(_steps(q))}{" (rewind)" if q["rewind"] else ""}</td>'
        f'<td>{_names(q["participants"])}</td><td>{_names(q["joiners"])}</td><td>{_names(q["left"])}</td>'
        f'<td>{_names(q["behind"])}</td><td>{_e(_ago(now, q["t"]))}</td></tr>' for q in rows)
    return ("<table id=quorums><tr><th>quorum</th><th>steps</th><th>participants</th><th>joined</th>"
            f"<th>left</th><th>behind (healed)</th><th>last handed out</th></tr>{body}</table>")


def _diagnosis_html(diagnosis: dict | None, now: float) -> str:
    if diagnosis is None:
        return '<p class="muted">no diagnosis monitor runs beside this lighthouse</p>'
    v = diagnosis.get("latest")
    if not v:
        return f'<p class="muted">no verdict yet ({_e(diagnosis.get("rounds", 0))} rounds)</p>'
    kind = str(v.get("kind", "?"))
    color = VERDICT_COLOR.get(kind, "#777")
    named = v.get("rank_names") or v.get("ranks") or []
    out = [f'<p id=verdict><span class="badge" style="background:{color}">{_e(kind.replace("_", " "))}</span> '
           f'{_e(v.get("reason", ""))} <span class="muted">({_e(_ago(now, v.get("t")))}, '
           f'{_e(v.get("num_answered", "?"))}/{_e(v.get("num_ranks", "?"))} ranks answered, '
           f'round {_e(diagnosis.get("rounds", "?"))})</span></p>']
    if named:
        out.append(f"<p>culprit ranks: {_names([str(x) for x in named])}; hosts: "
                   f"{_names([str(x) for x in v.get('hosts') or []])}</p>")
    shown = graph.shown_verdict(diagnosis)
    if shown is not None and shown is not v and shown.get("t") != v.get("t"):  # over now: what it was
        out.append(f'<p id=last-named>last named ({_e(_ago(now, shown.get("t")))}): <b>{_e(shown.get("kind"))}'
                   f'</b> {_e(shown.get("reason", ""))}</p>')
    g, placement = graph.graph_of(v if v.get("kind") != "no_hang" else shown)
    if g.nodes:
        out.append("<h3>wait-for graph <span class=muted>(waiter &rarr; waited on)</span></h3>")
        out.append(graph.svg(g, placement))
    changes = (diagnosis.get("verdicts") or [])[-VERDICTS_SHOWN:][::-1]
    if changes:
        body = "".join(f'<tr><td>{_e(_ago(now, c.get("t")))}</td><td>{_e(c.get("kind"))}</td>'
                       f'<td>{_names([str(x) for x in c.get("ranks") or []])}</td><td>{_e(c.get("reason"))}</td></tr>'
                       for c in changes)
        out.append("<h3>verdict changes</h3><table id=verdicts><tr><th>when</th><th>verdict</th><th>ranks</th>"
                   f"<th>reason</th></tr>{body}</table>")
    evictions = diagnosis.get("evictions") or []
    if evictions:
        body = "".join(f'<tr><td>{_e(_ago(now, x.get("t")))}</td><td>{_e(x.get("replica_id"))}</td>'
                       f'<td>{_e(x.get("incarnation"))}</td><td>{_e(x.get("reason"))}</td></tr>'
                       for x in evictions[-VERDICTS_SHOWN:][::-1])
        out.append("<h3>evictions</h3><table id=evictions><tr><th>when</th><th>replica</th><th>incarnation</th>"
                   f"<th>reason</th></tr>{body}</table>")
    return "".join(out)


def render(status: dict, history: list[dict], diagnosis: dict | None, now: float,
           refresh_s: int = REFRESH_S) -> str:
    """The whole page. `status`: Lighthouse.status(); `history`: its recent events; `diagnosis`: the
    monitor's report (None: no monitor)."""
    verdict = (diagnosis or {}).get("latest")
    replicas = replica_rows(status, history, verdict)
    finished = status.get("finished_step")
    summary = (f'<p class=summary><span>step <b id=step>{_e(status.get("max_step"))}</b></span>'
               f'<span>quorum <b>{_e(status.get("quorum_id"))}</b></span>'
               f'<span>{len(status.get("live", []))} live of {len(replicas)} replicas '
               f'(min {_e(status.get("min_replicas"))})</span>'
               + (f"<span><b>job finished at step {_e(finished)}</b></span>" if finished is not None else "")
               + f'</p><p>last decision: {_e(status.get("last_reason"))}</p>')
    return ("<!doctype html><html><head><meta charset=utf-8>"
            f'<meta http-equiv="refresh" content="{int(refresh_s)}"><title>ftrun lighthouse</title>'
            f"<style>{CSS}</style></head><body><h1>ftrun lighthouse <span class=muted>{_e(status.get('addr'))}"
            f"</span></h1>{summary}<h2>replicas</h2>{_replicas_html(replicas)}"
            f"<h2>diagnosis</h2>{_diagnosis_html(diagnosis, now)}"
            f"<h2>recent quorums</h2>{_quorums_html(quorum_rows(history), now)}"
            f'<p class=muted>refreshes every {int(refresh_s)} s</p></body></html>')


def login_form(error: str = "") -> str:
    """What a browser without the session cookie gets: a form that POSTs the job token (never in a URL)."""
    note = f'<p class=phase-lost id=error>{_e(error)}</p>' if error else ""
    return ("<!doctype html><html><head><meta charset=utf-8><title>ftrun lighthouse: job token</title>"
            f"<style>{CSS}</style></head><body><h1>ftrun lighthouse</h1>{note}"
            "<p>The status page needs the job token (the launcher's OUT/token, or the lighthouse's --token-file).</p>"
            '<form method=post action="/login"><input type=password name=token autocomplete=off size=40 autofocus> '
            "<button type=submit>open</button></form></body></html>")

