"""The status page and the wait-for graph drawing, pure: graph from a verdict, columns and rows, SVG, and the
page's phases, quorum history, escaping, and that the job token never reaches it."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np

from ftrun.diagnose import graph
from ftrun.diagnose.collect import display_edges, verdict_dict
from ftrun.diagnose.model import HANG, Layout, Verdict
from ftrun.quorum import page

HANG_VERDICT = {
    "kind": "hang", "reason": "rank 1 of replica 2 (h2) did not answer", "ranks": ["r2/1"],
    "rank_names": ["rank 1 of replica 2 (h2)"], "hosts": ["h2"], "replicas": [2], "silent": ["r2/1"],
    "collectives": ["ftar ring 1"], "t": 10.0, "num_ranks": 6, "num_answered": 5,
    "edges": [["quorum for step 9", "tree collective 4 of replica 0"],
              ["tree collective 4 of replica 0", "ftar ring 1"], ["tree collective 4 of replica 1", "ftar ring 1"],
              ["ftar ring 1", "rank 1 of replica 2 (h2)"]],
}


def test_graph_of_a_hang_puts_waiters_left_and_the_culprit_rightmost_in_red():
    g, p = graph.graph_of(HANG_VERDICT)
    kinds = {n.id: n.kind for n in g.nodes}
    assert kinds == {"quorum for step 9": "quorum", "tree collective 4 of replica 0": "tree",
                     "tree collective 4 of replica 1": "tree", "ftar ring 1": "ring",
                     "rank 1 of replica 2 (h2)": "culprit"}
    x = {k: p.pos[k][0] for k in kinds}
    assert x["quorum for step 9"] < x["tree collective 4 of replica 0"] < x["ftar ring 1"] \
        < x["rank 1 of replica 2 (h2)"]
    assert x["tree collective 4 of replica 1"] == x["tree collective 4 of replica 0"]
    assert len(set(p.pos.values())) == len(kinds)  # no two boxes on one spot
    for k, (bx, by) in p.pos.items():
        assert 0 <= bx and bx + graph.NODE_W <= p.width and 0 <= by and by + graph.NODE_H <= p.height, k
    assert graph.fill(graph.Node("x", "culprit")) == graph.CULPRIT_FILL


def test_a_verdict_without_edges_links_each_blocked_collective_to_each_culprit():
    v = {"kind": "candidates", "ranks": ["r0/1", "r1/1"], "rank_names": ["a", "b"], "collectives": ["ftar ring 1"]}
    g = graph.wait_graph(v)
    assert g.edges == (("ftar ring 1", "a"), ("ftar ring 1", "b"))
    assert {n.id: n.kind for n in g.nodes} == {"ftar ring 1": "ring", "a": "candidate", "b": "candidate"}
    slow = graph.wait_graph({"kind": "slow_host", "ranks": ["r0/0"], "rank_names": [], "hosts": ["h0"]})
    assert slow.nodes == (graph.Node("r0/0", "culprit"),) and slow.edges == ()
    assert graph.wait_graph(None).nodes == () and graph.svg(graph.wait_graph({"kind": "no_hang"})) == ""


def test_a_wide_column_folds_into_a_more_node_and_a_cycle_terminates():
    v = {"kind": "hang", "ranks": ["r0/0"], "rank_names": ["culprit"], "collectives": ["ftar ring 0"],
         "edges": [[f"tree collective 1 of replica {i}", "ftar ring 0"] for i in range(25)]
         + [["ftar ring 0", "culprit"]]}
    g, p = graph.graph_of(v)
    trees = [n for n in g.nodes if n.kind == "tree"]
    more = [n for n in g.nodes if n.kind == "more"]
    assert len(trees) == graph.MAX_PER_COLUMN - 1 and len(more) == 1 and more[0].id.startswith("+16 more")
    assert (more[0].id, "ftar ring 0") in g.edges
    cyc = graph.WaitGraph("hang", (graph.Node("a", "ring"), graph.Node("b", "ring")), (("a", "b"), ("b", "a")))
    assert set(graph.place(cyc).pos) == {"a", "b"}


def test_svg_is_well_formed_and_escapes_labels():
    v = {"kind": "hang", "ranks": ["x"], "rank_names": ['<script>alert("r")</script>&'], "collectives": ["ftar ring 0"]}
    out = graph.svg(*graph.graph_of(v))
    assert "<script>" not in out and "&lt;script&gt;" in out and "&amp;" in out
    assert out.startswith("<svg") and out.endswith("</svg>") and "href=\"http" not in out
    _parse(out)


def test_display_edges_link_each_culprit_to_its_ring():
    layout = Layout(replica=np.array([0, 0, 1, 1]), group=np.array([0, 1, 0, 1]), host=np.array([0, 0, 1, 1]),
                    ring_pos=np.array([0, 0, 1, 1]), host_names=("h0", "h1"))
    v = Verdict(HANG, "stuck", ranks=(3,), hosts=(1,), replicas=(1,), collectives=("ftar ring 1",),
                edges=(("tree collective 5 of replica 0", "ftar ring 1"),))
    assert display_edges(v, layout) == [["tree collective 5 of replica 0", "ftar ring 1"],
                                        ["ftar ring 1", "rank 1 of replica 1 (h1)"]]
    tree = Verdict(HANG, "stuck", ranks=(2,), collectives=("tree collective 5 of replica 1",))
    assert display_edges(tree, layout) == [["tree collective 5 of replica 1", "rank 0 of replica 1 (h1)"]]
    d = verdict_dict(v, layout, ["r0/0", "r0/1", "r1/0", "r1/1"])
    g = graph.wait_graph(d)
    assert ("ftar ring 1", "rank 1 of replica 1 (h1)") in g.edges and g.nodes[-1].kind == "culprit"


# -- the page ------------------------------------------------------------------------------------------
TOKEN = "s3cr3t-job-token"


def _status(**kw):
    s = {"addr": "127.0.0.1:5000", "quorum_id": 3, "max_step": 41, "finished_step": None,
         "participants": ["r0", "r1"], "live": ["r0", "r1", "r3"], "pending": ["r1"], "asks": {"r1": 42},
         "members": {"r0": {"connected": True, "heard_s_ago": 0.1}, "r1": {"connected": True, "heard_s_ago": 0.2},
                     "r2": {"connected": False, "heard_s_ago": 9.0}, "r3": {"connected": True, "heard_s_ago": 0.0},
                     "r4": {"connected": False, "heard_s_ago": 3.0}},
         "last_reason": "formed: all 2 live replicas asked", "min_replicas": 1}
    s.update(kw)
    return s


HISTORY = [
    {"t": 1.0, "event": "member_joined", "replica_id": "r0"}, {"t": 1.0, "event": "member_joined", "replica_id": "r1"},
    {"t": 1.0, "event": "member_joined", "replica_id": "r2"}, {"t": 1.0, "event": "member_joined", "replica_id": "r4"},
    {"t": 2.0, "event": "quorum", "quorum_id": 1, "participants": ["r0", "r1", "r2"], "max_step": 0, "behind": []},
    {"t": 3.0, "event": "member_lost", "replica_id": "r2", "why": "lost"},
    {"t": 3.5, "event": "member_evicted", "replica_id": "r4", "why": "diagnosis: silent"},
    {"t": 4.0, "event": "quorum", "quorum_id": 2, "participants": ["r0", "r1"], "max_step": 7, "behind": []},
    {"t": 5.0, "event": "member_joined", "replica_id": "r3"},
    {"t": 6.0, "event": "quorum", "quorum_id": 3, "participants": ["r0", "r1", "r3"], "max_step": 41,
     "behind": ["r3"]},
]


def test_replica_phases():
    rows = {r["replica_id"]: r for r in page.replica_rows(_status(participants=["r0", "r1"]), HISTORY)}
    assert rows["r0"]["phase"] == "training"
    assert rows["r1"]["phase"] == "waiting" and rows["r1"]["detail"] == "waiting for a quorum (step 42)"
    assert rows["r2"]["phase"] == "lost" and rows["r2"]["detail"] == "lost (lost)"
    assert rows["r3"]["phase"] == "joining"
    back = _status()
    back["members"]["r2"]["expected"] = True
    assert {r["replica_id"]: r["phase"] for r in page.replica_rows(back, [])}["r2"] == "reconnecting"
    rows = {r["replica_id"]: r for r in page.replica_rows(_status(participants=["r0", "r1", "r3"]), HISTORY)}
    assert rows["r3"]["phase"] == "healing" and rows["r3"]["detail"] == "catching up to step 41 from a peer"
    assert rows["r4"]["phase"] == "evicted" and "diagnosis: silent" in rows["r4"]["detail"]
    named = page.replica_rows(_status(), HISTORY, {"kind": "hang", "ranks": ["r1/0"], "silent": []})
    assert [r["replica_id"] for r in named if r["suspect"]] == ["r1"]
    assert not any(r["suspect"] for r in page.replica_rows(_status(), HISTORY, {"kind": "no_hang", "ranks": ["r1/0"]}))


def test_quorum_history_newest_first_with_joiners_and_leavers():
    rows = page.quorum_rows(HISTORY)
    assert [q["quorum_id"] for q in rows] == [3, 2, 1]
    assert rows[0]["joiners"] == ["r3"] and rows[0]["behind"] == ["r3"] and rows[0]["step"] == 41
    assert rows[1]["left"] == ["r2"] and rows[1]["joiners"] == []
    assert rows[2]["joiners"] == []  # the first quorum: nobody "joins" a previous one
    assert len(page.quorum_rows(HISTORY * 10, limit=4)) == 4
    fast = [{"t": 7.0 + i, "event": "quorum", "quorum_id": 3, "participants": ["r0", "r1", "r3"], "max_step": 42 + i,
             "behind": []} for i in range(5)]
    rows = page.quorum_rows(HISTORY + fast)  # the fast path: one row per quorum id and membership
    assert [(q["quorum_id"], q["step"], q["last_step"], q["hand_outs"]) for q in rows] == [
        (3, 41, 46, 6), (2, 7, 7, 1), (1, 0, 0, 1)]
    assert rows[0]["behind"] == ["r3"] and rows[0]["t"] == 11.0
    assert "41\u201346" in page.render(_status(), HISTORY + fast, None, now=12.0)


def _report(verdict):
    return {"rounds": 7, "latest": verdict, "verdicts": [dict(verdict)],
            "evictions": [{"t": 9.0, "replica_id": "r2", "incarnation": 0, "reason": "culprit silent"}]}


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text, self.stack = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    p.close()
    return p


def test_page_shows_the_job_the_verdict_and_its_graph():
    html = page.render(_status(), HISTORY, _report(HANG_VERDICT), now=12.0)
    p = _parse(html)
    text = " ".join(p.text)
    assert "step 41" in re.sub(r"\s+", " ", text) and "waiting for a quorum (step 42)" in text
    assert "rank 1 of replica 2 (h2) did not answer" in text and "culprit silent" in text
    tags = [t for t, _ in p.tags]
    assert "svg" in tags and "script" not in tags and tags.count("meta") == 2
    assert any(t == "meta" and a.get("http-equiv") == "refresh" for t, a in p.tags)
    assert any(t == "rect" and a.get("fill") == graph.CULPRIT_FILL for t, a in p.tags)
    assert not any(v and ("http://" in v or "https://" in v) for _, a in p.tags for k, v in a.items()
                   if k in ("src", "href")), "the page fetches nothing"
    assert 'tr class="suspect"' in html  # r2 is named


def test_page_escapes_every_replica_id_and_never_holds_the_token():
    evil = '<img src=x onerror="alert(1)">'
    status = _status(members={evil: {"connected": True, "heard_s_ago": 0.0}}, participants=[evil], pending=[],
                     live=[evil], last_reason=f"formed: {evil}", addr=f"{evil}")
    history = [{"t": 1.0, "event": "member_joined", "replica_id": evil},
               {"t": 2.0, "event": "quorum", "quorum_id": 1, "participants": [evil], "max_step": 1}]
    verdict = dict(HANG_VERDICT, reason=evil, ranks=[evil + "/0"], rank_names=[evil], edges=[["ftar ring 0", evil]])
    html = page.render(status, history, _report(verdict), now=3.0)
    assert "<img" not in html and "&lt;img" in html
    assert not any(t == "img" for t, _ in _parse(html).tags)
    for args in [(_status(), HISTORY, _report(HANG_VERDICT)), (_status(), [], None),
                 (_status(members={}), [], {"latest": None})]:
        assert TOKEN not in page.render(*args, now=0.0)


def test_page_without_a_monitor_or_a_verdict_says_so():
    assert "no diagnosis monitor" in page.render(_status(), HISTORY, None, now=1.0)
    assert "no verdict yet" in page.render(_status(), HISTORY, {"rounds": 0, "latest": None}, now=1.0)
    done = page.render(_status(finished_step=50), HISTORY, None, now=1.0)
    assert "job finished at step 50" in done


# -- the launch report --------------------------------------------------------------------------------
def test_the_report_draws_the_last_verdict_that_named_something():
    no = {"kind": "no_hang", "reason": "fine", "ranks": []}
    assert graph.shown_verdict({"verdicts": [no, HANG_VERDICT, no], "latest": no}) is HANG_VERDICT
    assert graph.shown_verdict({"verdicts": [no], "latest": no}) is no
    assert graph.shown_verdict(None) is None
    data = graph.as_json(HANG_VERDICT)
    assert ["ftar ring 1", "rank 1 of replica 2 (h2)"] in data["edges"]
    assert {n["kind"] for n in data["nodes"]} == {"quorum", "tree", "ring", "culprit"}


def test_report_png_has_the_graph_panel_with_the_culprit_in_red(tmp_path):
    from PIL import Image

    from ftrun.launch.report_png import draw

    events = [{"event": "commit", "replica_id": rid, "incarnation": 0, "rank": 0, "step": step + 1, "t": float(step)}
              for step in range(3) for rid in ("r0", "r1")]
    diagnosis = {"rounds": 3, "latest": {"kind": "no_hang"}, "verdicts": [HANG_VERDICT], "evictions": []}
    path = draw(events, str(tmp_path / "report.png"), title="t", diagnosis=diagnosis)
    px = np.asarray(Image.open(path).convert("RGB")).astype(np.int16)
    red = np.array([0xE0, 0x30, 0x1E])
    assert (np.abs(px - red).sum(axis=2) <= 12).sum() > 200
    plain = np.asarray(Image.open(draw(events, str(tmp_path / "plain.png"), title="t")).convert("RGB")).astype(np.int16)
    assert (np.abs(plain - red).sum(axis=2) <= 12).sum() == 0 and plain.shape[0] < px.shape[0]


def test_launch_trace_has_quorums_verdicts_with_their_graph_steps_and_evictions(tmp_path):
    from ftrun.launch.trace import launch_trace, read_events

    events = [{"event": "commit", "replica_id": "r0", "incarnation": 0, "rank": 0, "step": s, "t": 100.0 + s}
              for s in (1, 2, 3)] + [{"event": "kill", "replica_id": "r2", "incarnation": 0, "why": "evicted",
                                      "t": 104.0}, {"event": "verdict", "kind": "hang", "t": 103.0}]
    diagnosis = {"verdicts": [dict(HANG_VERDICT, t=102.5), {"kind": "no_hang", "ranks": [], "t": 105.0}],
                 "evictions": [{"t": 103.5, "replica_id": "r2", "incarnation": 0, "reason": "culprit silent"}]}
    trace = launch_trace(events, HISTORY[4:5], diagnosis)["traceEvents"]
    by_name = {e["name"]: e for e in trace}
    assert by_name["quorum 1 (step 0)"]["pid"] == 0 and by_name["quorum 1 (step 0)"]["ts"] == 0.0  # t0: first event
    hang = by_name["verdict: hang"]
    assert hang["args"]["graph"]["edges"] and hang["args"]["ranks"] == ["r2/1"]
    assert by_name["hang: r2/1"]["dur"] == 2.5e6 and "evict r2" in by_name and "kill" in by_name
    assert [e["name"] for e in trace if e.get("cat") == "step"] == ["step 1", "step 2"]
    (tmp_path / "events.jsonl").write_text('{"event": "x", "t": 1}\n{torn\n[1]\n')
    assert read_events(str(tmp_path / "events.jsonl")) == [{"event": "x", "t": 1}]
    assert launch_trace([], [], None)["traceEvents"][0]["name"] == "process_name"


def test_after_a_hang_the_page_still_draws_the_last_named_verdict():
    report = {"rounds": 9, "latest": {"kind": "no_hang", "reason": "fine", "ranks": [], "t": 11.0},
              "verdicts": [dict(HANG_VERDICT), {"kind": "no_hang", "reason": "fine", "ranks": [], "t": 11.0}]}
    html = page.render(_status(), HISTORY, report, now=12.0)
    assert "last named (2.0s ago)" in html and 'class="node culprit"' in html
    quiet = {"rounds": 1, "latest": report["latest"], "verdicts": [report["latest"]]}
    html = page.render(_status(), HISTORY, quiet, now=12.0)
    assert "last named" not in html and "<svg" not in html
