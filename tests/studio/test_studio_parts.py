"""The studio's parts without a browser: the root's path gate, documents to passages (txt, md, pdf, docx, html,
record files), the data set table to JSONL the job reads, question/answer parsing and its generate process,
a run whose supervisor vanished (with and without its training), the supervisor passing signals on, the
refusals to listen beyond localhost without a password or to start on a bad root or password file, the
processes of a request dying with the studio, and a page load listing only what is on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env

from aidaptiv_ds.studio import data_sets, documents, qa
from aidaptiv_ds.studio.runs import Runs, RunSettings
from aidaptiv_ds.studio.workspace import StudioError, Workspace, safe_name


def byte_count(text: str) -> int:
    return len(text.encode())


# ---------------------------------------------------------------- the root


def test_paths_stay_under_the_root(tmp_path):
    ws = Workspace(tmp_path / "root")
    assert ws.inside("data/x.jsonl") == ws.root / "data" / "x.jsonl"
    for bad in ("../outside.txt", "/etc/passwd", "data/../../x"):
        with pytest.raises(StudioError, match="outside the studio's root"):
            ws.inside(bad)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", ws.root / "data" / "link")
    with pytest.raises(StudioError, match="outside"):
        ws.inside("data/link/file")
    assert safe_name("my data/../x") == "my-data-..-x" and safe_name("a/b") == "a-b"
    with pytest.raises(StudioError):
        safe_name("../")


# ---------------------------------------------------------------- documents


def minimal_pdf(pages: list[list[str]]) -> bytes:
    """A PDF with a text layer: each page's lines in Helvetica, top to bottom."""
    objs = ["<< /Type /Catalog /Pages 2 0 R >>", None, "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        body = "BT /F1 11 Tf 72 760 Td 14 TL " + " ".join(
            "(" + ln.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ") Tj T*" for ln in lines
        )
        body += " ET"
        objs.append(f"<< /Length {len(body)} >>\nstream\n{body}\nendstream")
        content = len(objs)
        objs.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {content} 0 R "
            "/Resources << /Font << /F1 3 0 R >> >> >>"
        )
        kids.append(f"{len(objs)} 0 R")
    objs[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out, offsets = b"%PDF-1.4\n", []
    for i, obj in enumerate(objs, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{obj}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def test_pdf_text_without_running_headers_page_numbers_or_broken_words(tmp_path):
    pages = [
        ["ACME Storage Manual", f"Chapter {i}: the swap space holds every exam-", f"ple layer {i} on the SSD.", str(i)]
        for i in range(1, 5)
    ]
    path = tmp_path / "manual.pdf"
    path.write_bytes(minimal_pdf(pages))
    got = documents.extract(path)
    assert got.kind == "document" and got.pages == 4
    assert "ACME Storage Manual" not in got.text, got.text
    assert "Chapter 2: the swap space holds every example layer 2 on the SSD." in got.text
    assert not any(line.strip().isdigit() for line in got.text.splitlines())
    assert any("repeated on most pages" in n for n in got.notes)


def test_only_a_pdfs_page_edges_lose_repeated_lines_and_page_numbers(tmp_path):
    # "Warning: keep the budget" stands inside every page: content, not a header; so does a year on its own line.
    pages = [
        ["ACME Manual", f"Section {i} starts here.", "Warning: keep the budget", "2023", f"Section {i} ends.", str(i)]
        for i in range(1, 5)
    ]
    path = tmp_path / "m.pdf"
    path.write_bytes(minimal_pdf(pages))
    text = documents.extract(path).text
    assert "ACME Manual" not in text and text.count("Warning: keep the budget") == 4 and text.count("2023") == 4
    # other formats lose nothing: a number on its own line, a hyphen at a line end, Markdown's lines
    (tmp_path / "t.txt").write_text("Released in\n2023\n\nwell-\nknown tools\n")
    assert documents.extract(tmp_path / "t.txt").text == "Released in 2023\n\nwell- known tools"
    (tmp_path / "l.md").write_text("# Steps\n\n- read the group\n- apply the update\n\n    code line\n")
    assert (
        documents.extract(tmp_path / "l.md").text == "# Steps\n\n- read the group\n- apply the update\n\n    code line"
    )


def test_html_cells_charset_and_docx_order(tmp_path):
    (tmp_path / "t.html").write_text(
        "<table><tr><th>Name</th><th>Age</th></tr><tr><td>Ada</td><td>36</td></tr></table>"
    )
    assert documents.extract(tmp_path / "t.html").text == "Name | Age\n\nAda | 36"
    page = '<html><head><meta charset="windows-1252"></head><body><p>caf\xe9</p></body></html>'
    (tmp_path / "w.html").write_bytes(page.encode("cp1252"))
    assert documents.extract(tmp_path / "w.html").text == "caf\u00e9"
    (tmp_path / "x.html").write_bytes("<p>caf\xe9</p>".encode("latin-1"))
    with pytest.raises(StudioError, match="not UTF-8 .* names no charset"):
        documents.extract(tmp_path / "x.html")
    (tmp_path / "bom.txt").write_bytes("\ufeffhello".encode("utf-8"))
    assert documents.extract(tmp_path / "bom.txt").text == "hello"
    (tmp_path / "renamed.docx").write_bytes(b"")
    with pytest.raises(StudioError, match="not a readable .docx"):
        documents.extract(tmp_path / "renamed.docx")
    import docx

    d = docx.Document()
    d.add_paragraph("Before the table.")
    table = d.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "budget", "2 GiB"
    d.add_paragraph("After the table.")
    d.save(tmp_path / "o.docx")
    assert documents.extract(tmp_path / "o.docx").text.split("\n\n") == [
        "Before the table.",
        "budget | 2 GiB",
        "After the table.",
    ]


def test_docx_paragraphs_and_tables(tmp_path):
    import docx

    d = docx.Document()
    d.add_paragraph("First paragraph about pinned memory.")
    d.add_paragraph("Second paragraph about the disk.")
    table = d.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "budget", "2 GiB"
    d.save(tmp_path / "notes.docx")
    text = documents.extract(tmp_path / "notes.docx").text
    assert text.split("\n\n") == [
        "First paragraph about pinned memory.",
        "Second paragraph about the disk.",
        "budget | 2 GiB",
    ]


def test_html_keeps_visible_text_only(tmp_path):
    (tmp_path / "p.html").write_text(
        "<html><head><style>p{}</style><script>var x=1;</script></head><body><nav>Home | About</nav>"
        "<h1>Swap</h1><p>Layers are read &amp; written ahead.</p><footer>(c) 2026</footer></body></html>"
    )
    assert documents.extract(tmp_path / "p.html").text == "Swap\n\nLayers are read & written ahead."


def test_bad_documents_are_refused_with_the_reason(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(StudioError, match="not UTF-8"):
        documents.extract(tmp_path / "latin1.txt")
    (tmp_path / "x.exe").write_bytes(b"MZ")
    with pytest.raises(StudioError, match="reads .txt"):
        documents.extract(tmp_path / "x.exe")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4 nothing")
    with pytest.raises(StudioError, match="broken.pdf"):
        documents.extract(tmp_path / "broken.pdf")
    (tmp_path / "empty.md").write_text("\n\n   \n")
    with pytest.raises(StudioError, match="holds no text"):
        documents.extract(tmp_path / "empty.md")
    (tmp_path / "bad.jsonl").write_text('{"instruction": "x"}\n{"prompt": "q", "response": "a"}\n')
    with pytest.raises(StudioError, match="1 record\\(s\\) the job cannot train on: .*bad.jsonl:1"):
        documents.extract(tmp_path / "bad.jsonl")


def test_record_files_come_through_the_jobs_reader(tmp_path):
    import pandas as pd

    pd.DataFrame([{"instruction": "Add.", "input": "2 and 3", "output": "5"}]).to_parquet(tmp_path / "a.parquet")
    got = documents.extract(tmp_path / "a.parquet")
    assert got.kind == "records" and got.records == [{"instruction": "Add.", "input": "2 and 3", "output": "5"}]
    (tmp_path / "c.csv").write_text("prompt,response\nQ?,A.\n")
    assert documents.extract(tmp_path / "c.csv").records == [{"prompt": "Q?", "response": "A."}]


def test_passages_keep_paragraphs_whole_and_respect_the_limit():
    paras = ["Short one.", "Another short one.", "A much longer paragraph. " * 20, "Tail."]
    out = documents.passages("\n\n".join(paras), 64, byte_count)
    assert all(byte_count(p) <= 64 for p in out)
    assert out[0].startswith("Short one.\n\nAnother short one.\n\n")  # packed together, paragraphs intact
    assert "paragraph.\n\nA much" not in "".join(out)  # a long paragraph's sentences stay one paragraph
    assert out[-1].endswith("Tail.")
    assert " ".join(out).split() == " ".join(paras).split()  # nothing lost, nothing added
    one_word = documents.passages("x" * 200, 64, byte_count)
    assert [len(p) for p in one_word] == [64, 64, 64, 8]
    with pytest.raises(StudioError, match="too short"):
        documents.passages("text", 4, byte_count)


# ---------------------------------------------------------------- the data set


def test_rows_to_the_jsonl_the_job_trains_on(tmp_path):
    from aidaptiv_ds.job.data import load_texts

    rows = [
        [True, "doc.md", "text", "", "", "", "A passage."],
        [False, "doc.md", "text", "", "", "", "Dropped."],
        [True, "a.jsonl", "instruction", "Add.", "2 and 3", "5", ""],
        [True, "c.jsonl", "messages", "", "", "", json.dumps([{"role": "user", "content": "Hi"}])],
    ]
    records = data_sets.rows_to_records(rows)
    assert records == [
        {"text": "A passage."},
        {"instruction": "Add.", "context": "2 and 3", "response": "5"},
        {"messages": [{"role": "user", "content": "Hi"}]},
    ]
    path = data_sets.save(records, tmp_path / "data" / "set.jsonl")
    texts = load_texts(str(path))
    assert texts[0] == "A passage." and texts[1].startswith("### Instruction:\nAdd.")
    assert [r[2] for r in data_sets.load_rows(path)] == ["text", "instruction", "messages"]
    s = data_sets.summary(records, "micro")
    assert (
        s["records"] == 3
        and s["bytes"] == path.stat().st_size
        and s["kinds"] == {"text": 1, "instruction": 1, "messages": 1}
    )
    assert s["tokens"] > len("A passage.") + 2


def test_every_bad_row_is_listed():
    rows = [
        [True, "", "text", "", "", "", ""],
        [True, "", "instruction", "Q", "", "", ""],
        [True, "", "messages", "", "", "", "not json"],
        [True, "", "poem", "", "", "", "x"],
    ]
    with pytest.raises(StudioError) as e:
        data_sets.rows_to_records(rows)
    for fragment in ("row 1", "row 2", "row 3", "row 4", "kind 'poem'"):
        assert fragment in str(e.value)
    with pytest.raises(StudioError, match="no kept rows"):
        data_sets.rows_to_records([[False, "", "text", "", "", "", "x"]])


# ---------------------------------------------------------------- questions and answers


def test_a_set_that_is_not_jsonl_is_refused_with_its_line(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(StudioError, match="hand.jsonl:2 is not a JSON record"):
        data_sets.load_rows(path)


def test_question_and_answer_parsing():
    assert qa.parse(" What holds the layers?\nAnswer: The SSD.\nQuestion: more") == (
        "What holds the layers?",
        "The SSD.",
    )
    assert qa.parse("What?\nAnswer: That.") == ("What?", "That.")
    assert qa.parse("no answer here") is None
    assert qa.parse("Q\nAnswer:   ") is None
    # the answer ends where the model goes on with something else, and a cut one is not kept
    assert qa.parse("Why?\nAnswer: Speed.\nExplanation: more text") == ("Why?", "Speed.")
    assert qa.parse("Why?\nAnswer: Speed.\n\nPassage: x") == ("Why?", "Speed.")
    assert qa.parse("Why?\nAnswer: because the disk is", cut=True) is None
    assert qa.parse("Why?\nAnswer: Speed.\nQuestion: next", cut=True) == ("Why?", "Speed.")


def test_questions_from_a_local_model_run_as_one_generate_process(tmp_path):
    """A random-weight model writes no question/answer form: every completion is counted as left out, none
    is guessed into a record. (No model that writes real questions can be downloaded here.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      vocab_size=300, bos_token_id=256, eos_token_id=257, pad_token_id=258)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    save_byte_tokenizer(str(tmp_path / "m"))
    steps = list(
        qa.generate_records(str(tmp_path / "m"), ["The SSD holds layers.", "Pinned memory."], max_new_tokens=8)
    )
    done, records, skipped = steps[-1]
    assert done == 2 and records == [] and skipped == 2
    assert [s[0] for s in steps[:-1]] == [1]  # the first passage's completion counted before the second's
    with pytest.raises(StudioError, match="generate failed"):
        list(qa.generate_records(str(tmp_path / "nowhere"), ["x"]))


def test_an_answer_not_in_its_passage_is_ungrounded():
    passage = "The capital of Veltrane is Port Imbrey, a harbour city on Cazeroth."
    assert qa.grounded("Port Imbrey", passage) and qa.grounded("It is Port Imbrey.", passage)
    assert not qa.grounded("The answer is:", passage)  # no content word at all
    assert not qa.grounded("Paris, the capital of France", passage)
    assert qa.parse("Question: What is the capital?\nAnswer: Port Imbrey") == ("What is the capital?", "Port Imbrey")


# ---------------------------------------------------------------- runs and the command


def run_with_a_dead_supervisor(tmp_path):
    """A workspace with run "r" created, its data set, and the pid of a process that has ended."""
    ws = Workspace(tmp_path / "root")
    data = ws.data / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    runs = Runs(ws)
    runs.create(RunSettings(name="r", model="micro", data=str(data), nvme_path=str(ws.swap)))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return ws, data, runs, dead


def test_a_run_whose_supervisor_is_gone_is_shown_as_lost(tmp_path):
    ws, data, runs, dead = run_with_a_dead_supervisor(tmp_path)
    (ws.runs / "r" / "status.json").write_text(
        json.dumps({"state": "running", "attempt": 1, "supervisor_pid": dead.pid, "supervisor_started": time.time()})
    )
    st = runs.status("r")
    assert st["state"] == "lost" and "resume it" in st["message"]
    with pytest.raises(StudioError, match="exists"):
        runs.create(RunSettings(name="r", model="micro", data=str(data), nvme_path=str(ws.swap)))
    with pytest.raises(StudioError) as e:
        runs.create(RunSettings(name="s", model="micro", data="/nope.jsonl", nvme_path="x", seq_len=0, steps=None))
    assert "seq len must be at least 1" in str(e.value) and "give steps or epochs" in str(e.value)
    assert "not a file" in str(e.value)


def test_a_training_that_outlived_its_supervisor_is_running_and_stop_interrupts_it(tmp_path):
    ws, _, runs, dead = run_with_a_dead_supervisor(tmp_path)
    # A stand-in for the training: its own session, as the supervisor starts it; SIGINT ends it with 130. SIGINT at
    # its default first, as the training has it: the supervisor handles SIGINT, so the process it execs starts with
    # the default, while this one inherits pytest's, which is "ignored" when the suite runs in the background of a
    # non-interactive shell (the test then waited out its 30 s). It says when it is inside the try.
    train = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "try:\n    print('ready', flush=True)\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
            "    raise SystemExit(130)",
        ],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert train.stdout.readline().strip() == "ready"
        status = {"state": "running", "attempt": 1, "supervisor_pid": dead.pid, "supervisor_started": time.time()}
        status.update(train_pid=train.pid, train_started=time.time())
        (ws.runs / "r" / "status.json").write_text(json.dumps(status))
        st = runs.status("r")
        assert st["state"] == "running" and "Stop interrupts it" in st["message"]
        with pytest.raises(StudioError, match="stop it first"):
            runs.launch("r")  # no second training beside it
        runs.stop("r")
        assert train.wait(timeout=30) == 130
    finally:
        train.kill()
        train.stdout.close()


def test_the_supervisor_passes_a_signal_on_to_the_training(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    marker = tmp_path / "got-sigterm"
    code = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(3)))\n"
        "time.sleep(60)\n"
    )
    (folder / "argv-attempt1.json").write_text(json.dumps([sys.executable, "-c", code]))
    sup = subprocess.Popen([sys.executable, "-m", "aidaptiv_ds.studio.supervise", str(folder), "1"], env=child_env())
    try:
        status = folder / "status.json"
        deadline = time.time() + 60
        while time.time() < deadline and not (status.exists() and "train_pid" in status.read_text()):
            time.sleep(0.2)
        time.sleep(1.0)  # the child has installed its handler
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=60) == 0
        assert marker.exists()
        st = json.loads((folder / "status.json").read_text())
        assert st["state"] == "failed" and st["exit_code"] == 3
    finally:
        sup.kill()


def test_the_training_answers_sigint_even_when_the_studio_ignores_it(tmp_path):
    """A studio started in the background of a script ignores SIGINT, and children inherit "ignored" across exec;
    the supervisor handles SIGINT, so the training it starts has the default, and Stop (SIGINT) reaches it."""
    folder = tmp_path / "run"
    folder.mkdir()
    seen = tmp_path / "sigint"
    code = f"import signal\nopen({str(seen)!r}, 'w').write(str(signal.getsignal(signal.SIGINT) is signal.default_int_handler))\n"
    (folder / "argv-attempt1.json").write_text(json.dumps([sys.executable, "-c", code]))
    done = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds.studio.supervise", str(folder), "1"],
        env=child_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        timeout=120,
    )
    assert done.returncode == 0 and seen.read_text() == "True"


def test_a_bad_root_or_password_file_is_refused_with_the_reason(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    for extra, says in (
        (["--root", str(blocked / "sub")], "cannot use --root"),
        (["--password-file", str(tmp_path / "missing")], "cannot read --password-file"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "aidaptiv_ds", "studio", "--root", str(tmp_path / "r"), *extra],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_listening_beyond_localhost_needs_a_password(tmp_path):
    env = child_env()
    env.pop("AIDAPTIV_STUDIO_PASSWORD", None)
    done = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "studio", "--host", "0.0.0.0", "--root", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "without a password" in done.stderr, done.stderr


def test_uploads_are_capped_and_land_under_the_root(tmp_path):
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aidaptiv_ds",
            "studio",
            "--root",
            str(root),
            "--port",
            str(port),
            "--max-upload",
            "1KB",
        ],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/gradio_api/upload"
        deadline = time.time() + 120
        while True:
            try:
                small = httpx.post(url, files={"files": ("small.txt", b"x" * 500)}, timeout=10)
                break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, "the studio did not start"
                time.sleep(0.5)
        assert small.status_code == 200, small.text
        assert all(p.startswith(str(root.resolve())) for p in small.json()), small.json()
        big = httpx.post(url, files={"files": ("big.txt", b"x" * 3000)}, timeout=10)
        assert big.status_code == 413, big.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_plans_full_fine_tuning_verdict_gates_full_runs_only():
    # `plan` counts full fine-tuning of every weight: llama2-13b's 218 GiB of state is refused on this disk, but
    # its LoRA (a 48.5 GiB frozen base) trains, and train's own guard checks the base at launch.
    from aidaptiv_ds.studio.runs import launch_refusal

    no = {"backends": {"aidaptiv": {"fits": False, "problems": ["NVMe space: needs 218.2 GiB per node"]}}}
    yes = {"backends": {"aidaptiv": {"fits": True, "problems": []}}}
    assert "cannot fit this job: NVMe space: needs 218.2 GiB" in launch_refusal(no, "full")
    assert launch_refusal(no, "lora") is None
    assert launch_refusal(yes, "full") is None and launch_refusal(yes, "lora") is None


def test_two_compares_at_once_use_swap_folders_of_their_own_and_leave_none(tmp_path, monkeypatch):
    """Two browser tabs comparing at once: each compare's generate processes get a swap folder of their own
    under the workspace's swap (one would refuse the other's lock otherwise), removed when the compare ends."""
    import io

    from aidaptiv_ds.studio import compare

    started = []

    class Finished:  # a generate process that has printed its text and ended
        def __init__(self, argv, **kw):
            started.append(argv)
            nvme = argv[argv.index("--nvme-path") + 1]
            assert os.path.isdir(nvme), "generate takes an existing swap folder: the compare makes it"
            os.makedirs(os.path.join(nvme, "aidaptiv-swap"))  # what a killed side would leave
            self.stdout, self.stderr, self.returncode = io.BytesIO(b"text"), io.BytesIO(b""), 0

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

        def kill(self):
            pass

    monkeypatch.setattr(compare.subprocess, "Popen", Finished)
    swap = tmp_path / "swap"
    first = compare.side_by_side("a", "b", "hello", 4, None, str(swap), every_s=0.01)
    second = compare.side_by_side("a", "b", "hello", 4, None, str(swap), every_s=0.01)
    shown = [next(first), next(second)]  # both compares running
    for _ in range(500):  # each starts its second side once its first has ended (the stand-in ends at once)
        if len(started) == 4:
            break
        shown = [next(first, shown[0]), next(second, shown[1])]
    nvme = [argv[argv.index("--nvme-path") + 1] for argv in started]
    assert len(nvme) == 4 and len(set(nvme)) == 4, nvme
    assert all(p.startswith(str(swap)) for p in nvme)
    last = [([shown[0]] + list(first))[-1], ([shown[1]] + list(second))[-1]]  # both end
    assert [out[:2] for out in last] == [("text", "text")] * 2
    assert not os.listdir(swap), os.listdir(swap)


def test_the_second_model_starts_once_the_first_has_laid_out_its_weights(tmp_path, monkeypatch):
    """Each generate process sizes its default budgets from the memory free when it starts (on a GPU, three
    quarters of it), so the compare starts the second only after the first printed that its weights are laid
    out: two started together would both plan for the same free memory."""
    import io

    from aidaptiv_ds.studio import compare

    started = []

    class Running:  # a generate process whose stderr the test writes
        def __init__(self, argv, **kw):
            started.append(self)
            r, self.err_w = os.pipe()
            self.stdout, self.stderr, self.returncode = io.BytesIO(b""), os.fdopen(r, "rb"), None

        def say(self, line):
            os.write(self.err_w, line.encode())

        def end(self):
            os.close(self.err_w)
            self.returncode = 0

        def poll(self):
            return self.returncode

        def wait(self, timeout=None):
            return self.returncode

        def kill(self):
            if self.returncode is None:
                self.end()

    monkeypatch.setattr(compare.subprocess, "Popen", Running)
    gen = compare.side_by_side("a", "b", "hello", 4, None, None, every_s=0.01)
    for _ in range(20):
        out = next(gen)
    assert len(started) == 1 and "waiting for the first model's weights" in out[3]
    started[0].say("aidaptiv-ds generate: loading\n")  # not the lay-out line yet
    for _ in range(20):
        out = next(gen)
    assert len(started) == 1
    started[0].say(
        "aidaptiv-ds generate: 4.1 GiB of weights, 1.0 GiB resident (host budget 1.0 GiB, laid out in 5.3 s, cpu)\n"
    )
    for _ in range(500):
        if len(started) == 2:
            break
        next(gen)
    assert len(started) == 2
    started[0].end()
    started[1].end()
    list(gen)


def process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, Z, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_child_of_the_studio_dies_with_it_even_by_sigkill(tmp_path):
    """A stand-in studio starts a child through the studio's helper from a thread that then ends (as Gradio's
    idle workers do): the child lives on while the studio does, and dies when the studio is killed with SIGKILL,
    which no `finally` sees."""
    studio = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, threading, time\n"
            "from aidaptiv_ds.studio import children\n"
            "started = []\n"
            "asking = threading.Thread(target=lambda: started.append(children.popen(\n"
            "    [sys.executable, '-c', 'import time; time.sleep(600)'])))\n"
            "asking.start()\n"
            "asking.join()\n"
            "print(started[0].pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = int(studio.stdout.readline())
        time.sleep(1.0)  # the asking thread is gone: the child must outlive it
        assert process_state(child) not in (None, "Z"), "the child died with the thread that started it"
        studio.kill()
        studio.wait(timeout=30)
        deadline = time.time() + 10
        while process_state(child) not in (None, "Z") and time.time() < deadline:
            time.sleep(0.1)
        assert process_state(child) in (None, "Z"), "the child outlived the studio"
    finally:
        if studio.poll() is None:
            studio.kill()
        if child and process_state(child) not in (None, "Z"):
            os.kill(child, signal.SIGKILL)


def test_the_studio_starts_processes_through_the_helper_except_training():
    """Every process the studio starts dies with it (aidaptiv_ds.studio.children), except the training run's
    supervisor and the training itself, which are meant to outlive it."""
    import ast

    import aidaptiv_ds.studio as studio_package

    starts = {"Popen", "run", "call", "check_call", "check_output", "system", "fork", "spawnv", "posix_spawn"}
    direct = set()
    for path in sorted(Path(studio_package.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                f = node.func if isinstance(node, ast.Call) else None
                if (
                    isinstance(f, ast.Attribute)
                    and f.attr in starts
                    and isinstance(f.value, ast.Name)
                    and f.value.id in ("subprocess", "os")
                ):
                    direct.add((path.name, fn.name))
    assert direct == {
        ("children.py", "popen"),
        ("runs.py", "_launch"),  # the supervisor: its own session, outlives the studio
        ("supervise.py", "main"),  # the training, the supervisor's child
    }, direct


def test_a_page_load_offers_and_shows_only_what_is_on_disk(tmp_path):
    """A data set, model or run deleted or renamed since the studio started: the next page load (a refresh)
    neither offers it nor shows it as picked, in every dropdown fed from the disk."""
    import shutil

    import gradio as gr

    from aidaptiv_ds.studio import app

    root = tmp_path / "root"
    ws = Workspace(root)
    for i, name in enumerate(("old", "new")):  # "new" is the newest: the one the Train tab shows first
        (ws.data / f"{name}.jsonl").write_text('{"text": "x"}\n')
        os.utime(ws.data / f"{name}.jsonl", (1_000_000 + i, 1_000_000 + i))
    (ws.models / "base").mkdir()
    (ws.models / "base" / "config.json").write_text("{}")
    (ws.runs / "r1").mkdir()
    (ws.runs / "r1" / "settings.json").write_text(json.dumps({"name": "r1", "model": "micro", "data": ""}))
    page = app.build(str(root))
    load = next(f for f in page.fns.values() if f.name == "on_load")
    dropdowns = [b for b in page.blocks.values() if isinstance(b, gr.Dropdown)]
    static = [d.label for d in dropdowns if d not in load.outputs]
    assert static == ["Precision (auto: the model's own)"], static  # every other one is refreshed on load

    def shown():
        """Per dropdown: (what it offers, what it shows) after a page load; the page shows the value it was
        built with unless the load replaces it."""
        out = {}
        for d, update in zip(load.outputs, load.fn()):
            offered = [c[0] if isinstance(c, (list, tuple)) else c for c in update["choices"]]
            out[d.elem_id or d.label] = offered, update.get("value", d.value)
        return out

    before = shown()
    assert before["train-data"] == (["data/new.jsonl", "data/old.jsonl"], "data/new.jsonl"), before["train-data"]
    assert "models/base" in before["model-choice"][0] and before["model-a"] == (["models/base"], "models/base")
    assert before["run-pick"] == (["r1"], "r1")

    (ws.data / "new.jsonl").unlink()
    (ws.data / "old.jsonl").rename(ws.data / "renamed.jsonl")
    shutil.rmtree(ws.models / "base")
    shutil.rmtree(ws.runs / "r1")
    after = shown()
    assert after["train-data"] == (["data/renamed.jsonl"], "data/renamed.jsonl"), after["train-data"]
    assert after["saved-set"] == (["data/renamed.jsonl"], None) and after["run-pick"] == ([], None)
    assert after["model-a"] == after["chat-model"] == ([], None) and after["qa-model"] == (["none"], "none")
    for key, (offered, value) in after.items():
        assert not any("new.jsonl" in c or "old.jsonl" in c or "base" in c or c == "r1" for c in offered), key
        assert value is None or value in offered, (key, offered, value)
