"""The wait-for graph of a verdict, for people: which nodes, where they go, and as inline SVG.

Pure (no I/O): the status page (ftrun.quorum.page), the launch report's PNG (ftrun.launch.report) and its
trace draw the same graph from the same functions.

    wait_graph(verdict_dict) -> WaitGraph     nodes (kind: quorum, tree, ring, replica, culprit) and edges
    place(graph) -> Placement                 left to right: a waiter left of what it waits on
    svg(graph, placement) -> str              self-contained <svg>, every label escaped
    draw(ax, verdict) / trace_events(...)     the same graph on a matplotlib Axes / in a Perfetto trace

An edge points from the waiter to what it waits on (a quorum ask -> a replica's tree collective -> the FTAR
ring it is stuck in -> the culprit ranks), so the culprits are the sinks, drawn rightmost in red
(CULPRIT_FILL; a candidate set in orange). A verdict without edges (slow host/rank/link, or one from an older
collector) gets an edge from each blocked collective to each culprit. At most MAX_PER_COLUMN nodes a
column are drawn; the rest fold into one "+N more" node.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

MAX_PER_COLUMN = 10
MAX_LABEL = 40  # characters drawn in a box (the full label is its <title>)
NODE_W, NODE_H, GAP_X, GAP_Y, MARGIN = 250, 30, 60, 14, 10

CULPRIT_FILL = "#e0301e"  # a culprit (hang, slow): the page's browser test looks for this colour
CANDIDATE_FILL = "#ff9900"  # a member of a candidate set (sender or receiver)
FILL = {"quorum": "#9ecae1", "tree": "#fdd49e", "ring": "#fdae6b", "replica": "#c7e9c0", "more": "#dddddd",
        "collective": "#fdd49e"}


@dataclass(frozen=True)
class Node:
    id: str  # its label, unique in the graph
    kind: str  # quorum | tree | ring | replica | collective | culprit | candidate | more


@dataclass(frozen=True)
class WaitGraph:
    verdict: str  # the verdict's kind
    nodes: tuple[Node, ...]
    edges: tuple[tuple[str, str], ...]  # (waiter, waited on), both node ids


@dataclass(frozen=True)
class Placement:
    pos: dict[str, tuple[int, int]]  # node id -> (x, y) of its box's top-left corner
    width: int
    height: int


def _kind(label: str) -> str:
    for prefix, kind in (("quorum", "quorum"), ("tree collective", "tree"), ("ftar ring", "ring"),
                         ("replica", "replica")):
        if label.startswith(prefix):
            return kind
    return "collective"


def _culprits(verdict: dict) -> list[str]:
    """The culprit nodes' labels: the readable rank names, else the rank keys, else the hosts."""
    names = [str(x) for x in verdict.get("rank_names") or []]
    ranks = [str(x) for x in verdict.get("ranks") or []]
    if names and len(ranks) > len(names):
        names.append(f"and {len(ranks) - len(names)} more ranks")
    return names or ranks or [str(h) for h in verdict.get("hosts") or []]


def wait_graph(verdict: dict | None) -> WaitGraph:
    """The graph of a verdict dict (ftrun.diagnose.collect.verdict_dict); empty for no verdict or no hang."""
    if not verdict:
        return WaitGraph("none", (), ())
    kind = str(verdict.get("kind", ""))
    sink = "candidate" if kind == "candidates" else "culprit"
    culprits = _culprits(verdict)
    edges = [(str(a), str(b)) for a, b in verdict.get("edges") or []]
    collectives = [str(c) for c in verdict.get("collectives") or []]
    if not edges:
        edges = [(c, x) for c in collectives for x in culprits]
    nodes: dict[str, Node] = {}
    for a, b in edges:
        for label in (a, b):
            if label not in nodes:
                nodes[label] = Node(label, sink if label in culprits else _kind(label))
    for x in culprits:  # a culprit nothing was seen waiting on still shows
        nodes.setdefault(x, Node(x, sink))
    return WaitGraph(kind, tuple(nodes.values()), tuple(dict.fromkeys(edges)))


def _columns(graph: WaitGraph) -> dict[str, int]:
    """Column of each node: counted back from the sinks (the culprits, all in the last column), by its longest
    path to one, so what waits on a ring sits right before it. A cycle cannot push a path past the number
    of nodes."""
    dist = {n.id: 0 for n in graph.nodes}
    for _ in range(len(graph.nodes)):
        changed = False
        for a, b in graph.edges:
            if dist[a] < dist[b] + 1 <= len(graph.nodes):
                dist[a], changed = dist[b] + 1, True
        if not changed:
            break
    last = max(dist.values(), default=0)
    return {k: last - d for k, d in dist.items()}


def fold(graph: WaitGraph, limit: int = MAX_PER_COLUMN) -> WaitGraph:
    """At most `limit` nodes a column: the rest of a column become one "+N more" node (edges follow)."""
    col = _columns(graph)
    by_col: dict[int, list[Node]] = {}
    for n in graph.nodes:
        by_col.setdefault(col[n.id], []).append(n)
    rename: dict[str, str] = {}
    nodes: list[Node] = []
    for c in sorted(by_col):
        members = by_col[c]
        nodes += members[:limit - 1] if len(members) > limit else members
        if len(members) > limit:
            more = Node(f"+{len(members) - limit + 1} more (column {c + 1})", "more")
            nodes.append(more)
            rename.update({n.id: more.id for n in members[limit - 1:]})
    edges = tuple(dict.fromkeys((rename.get(a, a), rename.get(b, b)) for a, b in graph.edges))
    return WaitGraph(graph.verdict, tuple(nodes), edges)


def place(graph: WaitGraph) -> Placement:
    """Columns left to right (waiters left); within a column, nodes ordered by the mean row of what waits on
    them (ties: first seen), so edges cross little."""
    col = _columns(graph)
    rows: dict[str, float] = {}
    pos: dict[str, tuple[int, int]] = {}
    columns = sorted(set(col.values()))
    for c in columns:
        members = [n.id for n in graph.nodes if col[n.id] == c]
        parents = {m: [rows[a] for a, b in graph.edges if b == m and a in rows] for m in members}
        order = sorted(range(len(members)),
                       key=lambda i: (sum(parents[members[i]]) / len(parents[members[i]])
                                      if parents[members[i]] else float(i), i))
        for row, i in enumerate(order):
            rows[members[i]] = float(row)
            pos[members[i]] = (MARGIN + c * (NODE_W + GAP_X), MARGIN + row * (NODE_H + GAP_Y))
    tallest = max((sum(1 for v in col.values() if v == c) for c in columns), default=0)
    width = 2 * MARGIN + len(columns) * NODE_W + max(len(columns) - 1, 0) * GAP_X
    height = 2 * MARGIN + tallest * NODE_H + max(tallest - 1, 0) * GAP_Y
    return Placement(pos, width, height)


def fill(node: Node) -> str:
    return {"culprit": CULPRIT_FILL, "candidate": CANDIDATE_FILL}.get(node.kind) or FILL.get(node.kind, "#eeeeee")


def _short(label: str) -> str:
    return label if len(label) <= MAX_LABEL else label[:MAX_LABEL - 1] + "\u2026"


def svg(graph: WaitGraph, placement: Placement | None = None) -> str:
    """The graph as one inline <svg> element (no scripts, no external references); every label escaped."""
    if not graph.nodes:
        return ""
    p = placement or place(graph)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="waitfor" width="{p.width}" height="{p.height}" '
             f'viewBox="0 0 {p.width} {p.height}" role="img" aria-label="wait-for graph">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>']
    for a, b in graph.edges:
        (xa, ya), (xb, yb) = p.pos[a], p.pos[b]
        if xb > xa:
            x1, x2 = xa + NODE_W, xb
        else:  # same column (a cycle or two sinks): from the box's left edge, looping out
            x1, x2 = xa, xb
        parts.append(f'<line x1="{x1}" y1="{ya + NODE_H // 2}" x2="{x2}" y2="{yb + NODE_H // 2}" stroke="#555" '
                     f'stroke-width="1.2" marker-end="url(#arrow)"/>')
    for n in graph.nodes:
        x, y = p.pos[n.id]
        text_fill = "#ffffff" if n.kind == "culprit" else "#000000"
        parts.append(f'<g class="node {n.kind}" data-kind="{n.kind}"><title>{escape(n.id)}</title>'
                     f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5" fill="{fill(n)}" '
                     f'stroke="#333"/><text x="{x + 8}" y="{y + NODE_H // 2 + 4}" font-size="12" '
                     f'font-family="sans-serif" fill="{text_fill}">{escape(_short(n.id))}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def graph_of(verdict: dict | None) -> tuple[WaitGraph, Placement]:
    """The folded graph of a verdict and its placement: what every view draws."""
    g = fold(wait_graph(verdict))
    return g, place(g)


def as_json(verdict: dict | None) -> dict:
    """The drawn graph as plain data (report.json, the trace's args)."""
    g, p = graph_of(verdict)
    return {"nodes": [{"id": n.id, "kind": n.kind, "x": p.pos[n.id][0], "y": p.pos[n.id][1]} for n in g.nodes],
            "edges": [list(e) for e in g.edges]}


def shown_verdict(report: dict | None) -> dict | None:
    """The verdict a report draws from a monitor's report: the last one that named something (a hang, a
    slow rank or link: what the job was waiting on), else the latest."""
    if not report:
        return None
    named = [v for v in report.get("verdicts") or [] if v.get("kind") not in (None, "no_hang")]
    return named[-1] if named else report.get("latest")


def draw(ax, verdict: dict | None) -> None:
    """The wait-for graph on a matplotlib Axes (the launch report's PNG), placed as on the status page."""
    from matplotlib.patches import FancyBboxPatch

    g, p = graph_of(verdict)
    ax.set_axis_off()
    if not g.nodes:
        ax.text(0.5, 0.5, "no wait-for graph: " + (str(verdict.get("reason", "")) if verdict else "no verdict"),
                ha="center", va="center", transform=ax.transAxes, fontsize=9)
        return
    ax.set_xlim(0, max(p.width, 4 * (NODE_W + GAP_X)))  # boxes keep their shape in a wide panel
    ax.set_ylim(max(p.height, 3 * (NODE_H + GAP_Y)), 0)
    ax.set_aspect("equal", adjustable="box", anchor="W")
    for a, b in g.edges:
        (xa, ya), (xb, yb) = p.pos[a], p.pos[b]
        x1 = xa + NODE_W if xb > xa else xa
        ax.annotate("", xy=(xb, yb + NODE_H / 2), xytext=(x1, ya + NODE_H / 2),
                    arrowprops={"arrowstyle": "->", "color": "#555"})
    for n in g.nodes:
        x, y = p.pos[n.id]
        ax.add_patch(FancyBboxPatch((x, y), NODE_W, NODE_H, boxstyle="round,pad=0,rounding_size=5",
                                    facecolor=fill(n), edgecolor="#333"))
        ax.text(x + 8, y + NODE_H / 2, _short(n.id), va="center", fontsize=7,
                color="white" if n.kind == "culprit" else "black")


def trace_events(verdicts: list[dict], *, pid: int, t0: float, t_end: float) -> list[dict]:
    """Chrome trace events (Perfetto) of a monitor's verdict changes: an instant per verdict whose args hold
    its reason, ranks and drawn graph (thread 0), and a span for as long as one names something (thread 1).
    `t0`: the trace's zero; `t_end`: where the last span ends."""
    out = []
    for i, v in enumerate(verdicts):
        t = float(v["t"])
        args = {k: v.get(k) for k in ("kind", "reason", "ranks", "silent", "hosts", "collectives")}
        args["graph"] = as_json(v)
        out.append({"name": f"verdict: {v.get('kind')}", "cat": "diagnosis", "ph": "i", "s": "p", "pid": pid,
                    "tid": 0, "ts": round((t - t0) * 1e6, 3), "args": args})
        if v.get("kind") != "no_hang":
            end = float(verdicts[i + 1]["t"]) if i + 1 < len(verdicts) else t_end
            out.append({"name": f"{v.get('kind')}: {', '.join(map(str, v.get('ranks') or []))[:80]}",
                        "cat": "diagnosis", "ph": "X", "pid": pid, "tid": 1, "ts": round((t - t0) * 1e6, 3),
                        "dur": round(max(end - t, 0.0) * 1e6, 3), "args": {"reason": v.get("reason")}})
    return out

