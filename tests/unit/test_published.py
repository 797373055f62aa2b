"""The published numbers in aidaptiv_ds/harness/published.py, checked against the source documents' text
(shared/seeds/, found next to the checkout or through AIDAPTIV_DS_SEEDS; skipped when absent)."""

import os
import re

import pytest

from aidaptiv_ds.harness.published import POINTS, SOURCES, label, matching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _seeds():
    for d in (
        os.environ.get("AIDAPTIV_DS_SEEDS"),
        os.path.join(ROOT, "..", "shared", "seeds"),
        os.path.join(ROOT, "..", "..", "shared", "seeds"),
    ):
        if d and os.path.isdir(d):
            return d
    pytest.skip("source documents (shared/seeds) not found; set AIDAPTIV_DS_SEEDS")


def _seed(prefix):
    d = _seeds()
    (name,) = [f for f in os.listdir(d) if f.startswith(prefix)]
    with open(os.path.join(d, name)) as f:
        return f.read()


def test_every_point_has_a_source_and_a_sane_shape():
    for p in POINTS:
        assert p.source in SOURCES
        assert p.status in ("ok", "oom")
        assert p.qualifier in ("=", "~", ">", "<", "peak")
        assert p.tokens_per_s is None or p.tokens_per_s > 0
        assert label(p)


def test_table_vi_matches_the_paper():
    text = _seed("003_")
    block = text[text.index("TABLE VI.") :]
    block = block[: block.index("memory capacity")]
    parsed, seq = {}, None
    for line in block.splitlines():
        f = line.split("\t")
        if len(f) >= 6 and f[1].strip().isdigit():
            seq = int(f[0]) if f[0].strip() else seq
            vals = [None if v.strip() == "OOM" else int(v) for v in f[2:6]]
            parsed[(seq, int(f[1]))] = vals
    assert len(parsed) == 20
    for (seq, mb), (a1, a2, b1, b2) in parsed.items():
        for model, gpus, v in (
            ("llama2-7b", 1, a1),
            ("llama2-7b", 2, a2),
            ("llama3.1-8b", 1, b1),
            ("llama3.1-8b", 2, b2),
        ):
            (p,) = [p for p in matching(model, seq, mb, gpus) if p.source == "cdac-t6"]
            assert (p.tokens_per_s, p.status) == (v, "oom" if v is None else "ok"), (model, seq, mb, gpus)


def test_table_v_and_figure_8_match_the_paper():
    text = _seed("003_")
    rows = re.findall(r"^(\d) \((\d+)\)\t(\d+)\t(\d+)$", text, re.M)
    assert len(rows) == 4
    for g, mb, siddhi, rudra in rows:
        got = {
            p.gpu.split("(")[1][:-1]: p.tokens_per_s
            for p in matching("llama2-7b", 2048, int(mb), int(g))
            if p.source == "cdac-t5"
        }
        assert got == {"Siddhi": int(siddhi), "Rudra": int(rudra)}
    f8 = {p.gpus: p.tokens_per_s for p in POINTS if p.source == "cdac-f8"}
    assert f"**{f8[1]} tokens/sec** at batch size 80" in text
    assert f"maximum of **{f8[2]} tokens/sec**" in text


def test_signal65_times_match_the_report():
    text = _seed("000_")
    found = {}
    model = None
    for line in text.splitlines():
        f = line.split("\t")
        if f[0].strip():
            model = f[0].strip()
        if len(f) >= 4 and f[3].startswith("Complete"):
            h = re.search(r"(\d+)\s*hr", f[3])
            m = re.search(r"(\d+)\s*m(in)?\b", f[3])
            s = re.search(r"(\d+)\s*s\b", f[3])
            secs = (int(h.group(1)) if h else 0) * 3600 + (int(m.group(1)) if m else 0) * 60 + int(s.group(1))
            found[(model, int(f[1]))] = secs
            assert "out of memory" in f[4]
    assert len(found) == 12
    names = {
        "Llama-3.1-8B": "llama3.1-8b",
        "Llama-3.1-70B": "llama3.1-70b",
        "Qwen-2.5-7B": "qwen2.5-7b",
        "Qwen-2.5-72B": "qwen2.5-72b",
    }
    ok = {(p.model, p.gpus): p.completion_s for p in POINTS if p.source == "signal65" and p.status == "ok"}
    assert ok == {(names[m], g): s for (m, g), s in found.items()}
    assert len([p for p in POINTS if p.source == "signal65" and p.status == "oom"]) == 12


def test_phison_table_matches():
    text = _seed("001_")
    got = re.findall(r"^(\d)x\t([\d.:]+)\t(\d+)\t(\d+) / (\d+)\t(\d+)$", text, re.M)
    assert len(got) == 12
    ours = [p for p in POINTS if p.source == "phison-001"]
    assert [(p.gpus, p.tokens_per_s, p.micro_batch) for p in ours] == [
        (int(g), int(v), int(b)) for g, _, v, b, _, _ in got
    ]
    for p, (_, t, *_rest) in zip(ours, got):
        digits = re.findall(r"\d+", t)
        assert [int(x) for x in digits] == [int(x) for x in p.completion.split(":")][-len(digits) :]
