"""The studio's page (Gradio Blocks): Data, Train, Runs, Compare and Chat tabs over one Workspace.

Every handler turns the page's values into calls of documents/data_sets/qa/runs/compare, which drive the
product through `aidaptiv-ds` processes and files; a StudioError (or the product's own message) is shown in
the tab's message line, never as a traceback. What the page shows from the disk (the plan's table, the runs,
a run's curves and log, a sweep's report) is read by views.py.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from pathlib import Path

from aidaptiv_ds.studio import chat, compare, data_sets, documents, qa
from aidaptiv_ds.studio.runs import ACTIVE, Runs, RunSettings, launch_refusal, run_plan
from aidaptiv_ds.studio.views import LOG_LINES, render_plan, run_view, runs_table, sweep_folders, sweep_report
from aidaptiv_ds.studio.workspace import StudioError, Workspace, has_chat_template, safe_name

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls home from a lab's workstation


def _error(e: Exception) -> str:
    return f"**Error:** {e}"


def _guarded(fn):
    """Handlers return their outputs; on an error the message goes to the last output (the tab's message line)
    and every other output is left as it was. A StudioError is the user's to fix and shows as it is; anything
    else (a half-written file, an empty number field, a child that timed out) shows with its type, and its
    traceback goes to the studio's log."""

    @functools.wraps(fn)
    def wrapper(*args):
        try:
            return fn(*args)
        except Exception as e:
            import gradio as gr

            if not isinstance(e, StudioError):
                import traceback

                traceback.print_exc()
                e = StudioError(f"{type(e).__name__}: {e}")
            n = getattr(wrapper, "n_outputs", 1)
            return tuple([gr.update()] * (n - 1) + [_error(e)]) if n > 1 else _error(e)

    return wrapper


def _outputs(n):
    def deco(fn):
        w = _guarded(fn)
        w.n_outputs = n
        return w

    return deco


def picked(name: str) -> str:
    if not name:
        raise StudioError("pick a run first")
    return name


def _size(n: float) -> str:
    from aidaptiv_ds.common.sizes import format_size

    return format_size(n)


# ---------------------------------------------------------------- Data


def add_files(ws: Workspace, files, rows, tokenizer_model: str, passage_tokens, qa_model: str):
    """Uploaded files -> rows appended to the table; yields (rows, message): the passages at once, then the
    question/answer writer's progress, then its records (ungrounded ones unticked, for the user to read)."""
    if not files:
        raise StudioError("choose one or more files first")
    rows = [list(r) for r in _rows(rows)]
    count, _tok = data_sets.token_counter(ws.model_argument(tokenizer_model))
    notes, new_passages = [], []
    for f in files:
        src = Path(f if isinstance(f, str) else f.name)
        kept = ws.uploads / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe_name(src.name, 'file name')}"
        shutil.copyfile(src, kept)
        got = documents.extract(kept)
        if got.kind == "records":
            rows += [data_sets.record_row(rec, src.name) for rec in got.records]
            notes.append(f"{src.name}: {len(got.records)} records")
            continue
        parts = documents.passages(got.text, int(passage_tokens), count)
        rows += [[True, src.name, "text", "", "", "", p] for p in parts]
        new_passages += parts
        pages = f", {got.pages} pages" if got.pages else ""
        notes.append(f"{src.name}: {len(parts)} passages{pages}" + "".join(f" ({n})" for n in got.notes))
    if not (qa_model and qa_model != "none" and new_passages):
        yield rows, "Added: " + "; ".join(notes)
        return
    total = len(new_passages)
    model = ws.model_argument(qa_model)
    steps = (2 if has_chat_template(model) else 1) * total  # chat models: a question, then its answer
    said = "Added: " + "; ".join(notes) + f". {qa_model} is writing questions and answers"
    yield rows, f"{said}: 0 of {steps} prompts"
    for done, records, skipped in qa.generate_records(model, new_passages):
        if done < steps:
            yield rows, f"{said}: {done} of {steps} prompts"
    ungrounded = 0
    for rec in records:
        row = data_sets.record_row({"instruction": rec["instruction"], "response": rec["response"]}, "")
        row[0] = rec["grounded"]
        ungrounded += not rec["grounded"]
        row[1] = f"Q&A by {qa_model}" + ("" if rec["grounded"] else " (answer not found in its passage: check it)")
        rows.append(row)
    notes.append(
        f"{qa_model} wrote {len(records)} question/answer records from {total} passages"
        + (f"; {skipped} completions held no question and answer and were left out" if skipped else "")
        + (
            f"; {ungrounded} answers are not in their passage and are unticked: read them before keeping"
            if ungrounded
            else ""
        )
    )
    yield rows, "Added: " + "; ".join(notes)


def _rows(table) -> list:
    if table is None:
        return []
    if hasattr(table, "values"):  # a pandas DataFrame from the page
        return [list(r) for r in table.values.tolist() if any(str(c).strip() for c in r[1:])]
    return [list(r) for r in table]


def save_set(ws: Workspace, rows, name: str, tokenizer_model: str) -> str:
    records = data_sets.rows_to_records(_rows(rows))
    path = ws.data / f"{safe_name(name, 'data set name')}.jsonl"
    data_sets.save(records, path)
    s = data_sets.summary(records, ws.model_argument(tokenizer_model))
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(s["kinds"].items()))
    return (
        f"Saved **{ws.relative(path)}**: {s['records']} records ({kinds}), {_size(s['bytes'])}, "
        f"{s['tokens']:,} tokens for {tokenizer_model} (template and BOS/EOS included). "
        f"Train on it with `aidaptiv-ds train --data {path}` or in the Train tab."
    )


# ---------------------------------------------------------------- Train


def settings_from(ws: Workspace, values: dict) -> RunSettings:
    steps = int(values["steps"] or 0) or None
    epochs = float(values["epochs"] or 0) or None
    swap = ws.inside(values["nvme_path"] or "swap", "swap folder")
    return RunSettings(
        name=safe_name(values["name"], "run name"),
        model=ws.model_argument(values["model"]),
        data=str(ws.inside(values["data"], "data set")) if values["data"] else "",
        mode="lora" if str(values["mode"]).lower().startswith("lora") else "full",
        lora_r=int(values["lora_r"]),
        seq_len=int(values["seq_len"]),
        micro_batch=int(values["micro_batch"]),
        steps=steps,
        epochs=epochs,
        lr=float(values["lr"]),
        dtype=values["dtype"],
        nvme_path=str(swap),
        host_budget=(values["host_budget"] or "").strip(),
        save_every=int(values["save_every"]),
        eval_fraction=float(values["eval_fraction"] or 0),
    )


# ---------------------------------------------------------------- the page


def disk_choices(ws: Workspace, runs: Runs) -> dict[str, dict]:
    """Per dropdown fed from the disk (by elem_id): what it offers now, and what it shows picked at first (the
    newest entry, as Gradio picks the first, or a fixed default). The page is built with these, and every page
    load offers what exists then: a data set, model or run deleted or renamed since the studio started is
    neither offered nor shown as picked after a refresh."""
    sets, names, folders, sweeps = ws.data_sets(), runs.names(), ws.model_folders(), sweep_folders(ws)
    presets_and_folders = ws.model_choices()

    def newest(entries):
        return {"choices": entries, "value": entries[0] if entries else None}

    return {
        "tok-model": {"choices": presets_and_folders, "value": "micro"},
        "qa-model": {"choices": ["none"] + folders, "value": "none"},
        "saved-set": {"choices": sets, "value": None},
        "model-choice": {"choices": presets_and_folders, "value": "micro"},
        "train-data": newest(sets),
        "run-pick": newest(names),
        "sweep-pick": newest(sweeps),
        "model-a": newest(folders),
        "model-b": newest(folders),
        "chat-model": newest(folders),
    }


def build(root: str):
    import gradio as gr

    ws = Workspace(root)
    runs = Runs(ws)
    now = disk_choices(ws, runs)

    with gr.Blocks(title="aidaptiv-ds studio") as page:
        gr.Markdown(
            f"# aidaptiv-ds studio\nFine-tune models larger than this machine's memory. Everything lives under "
            f"`{ws.root}`."
        )
        with gr.Tab("Data", id="data"):
            with gr.Row():
                files = gr.File(
                    label="Documents (txt, md, pdf, docx, html) or records (jsonl, json, csv, parquet)",
                    file_count="multiple",
                    file_types=list(documents.ACCEPTED),
                    elem_id="upload",
                )
                with gr.Column():
                    tok_model = gr.Dropdown(
                        **now["tok-model"], label="Model the set is for (its tokenizer)", elem_id="tok-model"
                    )
                    passage_tokens = gr.Number(256, label="Passage length (tokens)", precision=0)
                    qa_model = gr.Dropdown(
                        **now["qa-model"],
                        label="Write question/answer records with (a local model)",
                        elem_id="qa-model",
                    )
                    add = gr.Button("Add to the set", elem_id="add-files")
                    data_msg = gr.Markdown(elem_id="data-msg")
            table = gr.Dataframe(
                headers=data_sets.COLUMNS,
                datatype=["bool", "str", "str", "str", "str", "str", "str"],
                interactive=True,
                wrap=True,
                label="Records (edit cells; untick keep to drop a row)",
                elem_id="records",
            )
            with gr.Row():
                set_name = gr.Textbox("my-data", label="Data set name", elem_id="set-name")
                save = gr.Button("Save data set", variant="primary", elem_id="save-set")
                saved = gr.Dropdown(**now["saved-set"], label="Open a saved set", elem_id="saved-set")
                open_set = gr.Button("Open")

        with gr.Tab("Train", id="train"):
            with gr.Row():
                run_name = gr.Textbox(f"run-{time.strftime('%m%d-%H%M')}", label="Run name", elem_id="run-name")
                model = gr.Dropdown(
                    **now["model-choice"], label="Model (preset: random weights; or a folder)", elem_id="model-choice"
                )
                data = gr.Dropdown(**now["train-data"], label="Data set", elem_id="train-data")
                mode = gr.Radio(["LoRA", "Full"], value="LoRA", label="Fine-tuning", elem_id="mode")
            with gr.Row():
                lora_r = gr.Number(8, label="LoRA rank", precision=0)
                seq_len = gr.Number(256, label="Sequence (tokens)", precision=0, elem_id="seq-len")
                micro_batch = gr.Number(1, label="Batch (sequences)", precision=0)
                steps = gr.Number(20, label="Steps (0: by epochs)", precision=0, elem_id="steps")
                epochs = gr.Number(0, label="Epochs (0: by steps)")
                lr = gr.Number(1e-4, label="Learning rate")
            with gr.Row():
                dtype = gr.Dropdown(["auto", "fp32", "bf16"], value="auto", label="Precision (auto: the model's own)")
                nvme = gr.Textbox("swap", label="Swap folder (on the SSD; under the root)")
                host_budget = gr.Textbox("", label="Host budget (e.g. 2GiB; empty: as planned)")
                save_every = gr.Number(5, label="Checkpoint every (steps)", precision=0, elem_id="save-every")
                eval_fraction = gr.Number(0, label="Held-out fraction")
            with gr.Row():
                plan_btn = gr.Button("Plan", elem_id="plan")
                launch_btn = gr.Button("Launch", variant="primary", elem_id="launch")
            train_msg = gr.Markdown(elem_id="train-msg")  # the verdict right under the buttons, the plan below
            plan_out = gr.Markdown(elem_id="plan-out")

        with gr.Tab("Runs", id="runs"):
            runs_df = gr.Dataframe(
                headers=["run", "model", "mode", "state", "step", "loss", "tokens/s", "started"],
                interactive=False,
                label="Runs",
                elem_id="runs-table",
            )
            with gr.Row():
                run_pick = gr.Dropdown(**now["run-pick"], label="Run", elem_id="run-pick")
                stop_btn = gr.Button("Stop", elem_id="stop")
                resume_btn = gr.Button("Resume", elem_id="resume")
                export_btn = gr.Button("Export", elem_id="export")
            runs_msg = gr.Markdown(elem_id="runs-msg")  # what Stop, Resume and Export did, next to them
            run_status = gr.Markdown(elem_id="run-status")
            # the log's last lines, where a failure says why (above the plots, all of it in view)
            log = gr.Textbox(label="Log (last lines)", lines=LOG_LINES, max_lines=2 * LOG_LINES, elem_id="run-log")
            with gr.Row():
                # steps are whole numbers: the axis says so (Vega's default ticks were 0.5, 1.5, ...)
                loss_plot = gr.LinePlot(
                    x="step", y="value", color="series", title="loss", x_axis_format="d", elem_id="loss-plot"
                )
                speed_plot = gr.LinePlot(x="step", y="value", color="series", title="tokens/s", x_axis_format="d")
            with gr.Row():
                nvme_plot = gr.LinePlot(x="step", y="value", color="series", title="NVMe GB/s", x_axis_format="d")
                mem_plot = gr.LinePlot(x="step", y="value", color="series", title="memory (MiB)", x_axis_format="d")
            with gr.Accordion("Sweeps", open=False):
                sweep_pick = gr.Dropdown(
                    **now["sweep-pick"], label="Sweep folder (under sweeps/)", elem_id="sweep-pick"
                )
                sweep_btn = gr.Button("Show report", elem_id="sweep-show")
                sweep_md = gr.Markdown(elem_id="sweep-report")
                sweep_figs = gr.Gallery(label="Figures", elem_id="sweep-figures")
            timer = gr.Timer(2.0)

        with gr.Tab("Compare", id="compare"):
            with gr.Row():
                model_a = gr.Dropdown(**now["model-a"], label="Model A (e.g. the base)", elem_id="model-a")
                model_b = gr.Dropdown(**now["model-b"], label="Model B (e.g. the fine-tuned)", elem_id="model-b")
            prompt = gr.Textbox("Once upon a time", label="Prompt", lines=3, elem_id="prompt")
            with gr.Row():
                max_new = gr.Number(32, label="New tokens", precision=0)
                cmp_budget = gr.Textbox("", label="Host budget per model (empty: auto)")
                cmp_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
            with gr.Row():
                out_a = gr.Textbox(label="A", lines=8, elem_id="out-a")
                out_b = gr.Textbox(label="B", lines=8, elem_id="out-b")
            with gr.Row():
                fig_a = gr.Markdown(elem_id="fig-a")
                fig_b = gr.Markdown(elem_id="fig-b")
            cmp_msg = gr.Markdown(elem_id="cmp-msg")

        with gr.Tab("Chat", id="chat"):
            with gr.Row():
                chat_model = gr.Dropdown(
                    **now["chat-model"], label="Model (an instruct model's folder)", elem_id="chat-model"
                )
                chat_name = gr.Textbox("chat", label="Conversation (kept under chats/)", elem_id="chat-name")
                chat_new = gr.Button("New conversation", elem_id="chat-new")
            chat_msg = gr.Markdown(elem_id="chat-msg")
            chatbot = gr.Chatbot(label="Conversation", elem_id="chatbot", height=360)
            with gr.Row():
                chat_text = gr.Textbox("", label="Message", lines=2, scale=4, elem_id="chat-text")
                chat_send = gr.Button("Send", variant="primary", elem_id="chat-send")
            with gr.Row():
                chat_new_tokens = gr.Number(128, label="New tokens", precision=0)
                chat_budget = gr.Textbox("", label="Host budget (empty: auto)")

        # -------- Data handlers
        def on_add(files_, rows, tok, n, qa_m):
            try:
                yield from add_files(ws, files_, rows, tok, n, qa_m)
            except Exception as e:  # the message line says it, as _guarded does for the other handlers
                if not isinstance(e, StudioError):
                    import traceback

                    traceback.print_exc()
                    e = StudioError(f"{type(e).__name__}: {e}")
                yield gr.update(), _error(e)

        add.click(on_add, [files, table, tok_model, passage_tokens, qa_model], [table, data_msg])

        @_outputs(3)
        def on_save(rows, name, tok):
            msg = save_set(ws, rows, name, tok)
            sets = ws.data_sets()
            return gr.update(choices=sets), gr.update(choices=sets, value=sets[0]), msg

        save.click(on_save, [table, set_name, tok_model], [saved, data, data_msg])

        @_outputs(2)
        def on_open(path):
            p = ws.inside(path, "data set")
            return data_sets.load_rows(p), f"Opened {ws.relative(p)}"

        open_set.click(on_open, [saved], [table, data_msg])

        # -------- Train handlers
        train_inputs = [
            run_name, model, data, mode, lora_r, seq_len, micro_batch, steps, epochs, lr, dtype, nvme,
            host_budget, save_every, eval_fraction,
        ]  # fmt: skip
        keys = [
            "name", "model", "data", "mode", "lora_r", "seq_len", "micro_batch", "steps", "epochs", "lr", "dtype",
            "nvme_path", "host_budget", "save_every", "eval_fraction",
        ]  # fmt: skip

        @_outputs(2)
        def on_plan(*values):
            s = settings_from(ws, dict(zip(keys, values)))
            plan = run_plan(s, ws.runs / ".plans" / s.name)
            fits = plan["backends"].get("aidaptiv", {}).get("fits")
            verdict = "aidaptiv **fits**" if fits else "aidaptiv **does not fit**: see why below"
            if not fits and s.mode == "lora":
                verdict = (
                    "full fine-tuning with aidaptiv **does not fit**; LoRA needs the frozen base only, which the "
                    "train job checks when launched"
                )
            return render_plan(plan, s.mode), f"Plan: {verdict}."

        plan_btn.click(on_plan, train_inputs, [plan_out, train_msg])

        @_outputs(4)
        def on_launch(*values):
            s = settings_from(ws, dict(zip(keys, values)))
            runs.check_new(s)
            planned = ws.runs / ".plans" / s.name  # never in runs/NAME before the name is claimed
            plan = run_plan(s, planned)
            refusal = launch_refusal(plan, s.mode)
            if refusal:
                raise StudioError(refusal)
            runs.create(s, planned)
            runs.launch(s.name)
            names = runs.names()
            return (
                render_plan(plan, s.mode),
                gr.update(choices=names, value=s.name),
                gr.update(value=f"run-{time.strftime('%m%d-%H%M%S')}"),
                f"Launched **{s.name}**: follow it in the Runs tab.",
            )

        launch_btn.click(on_launch, train_inputs, [plan_out, run_pick, run_name, train_msg])

        # -------- Runs handlers
        def refresh(name):
            try:
                return (runs_table(runs),) + run_view(runs, name)
            except Exception as e:  # a file caught mid-write: the next tick reads it whole
                print(f"aidaptiv-ds studio: refresh skipped: {type(e).__name__}: {e}", file=sys.stderr)
                return tuple(gr.update() for _ in view_outputs)

        view_outputs = [runs_df, run_status, loss_plot, speed_plot, nvme_plot, mem_plot, log]
        timer.tick(refresh, [run_pick], view_outputs)
        run_pick.change(refresh, [run_pick], view_outputs)

        @_outputs(1)
        def on_stop(name):
            return runs.stop(picked(name))

        stop_btn.click(on_stop, [run_pick], [runs_msg])

        @_outputs(1)
        def on_resume(name):
            st = runs.launch(picked(name))
            return f"Resumed {name}: attempt {st['attempt']} continues from the last checkpoint"

        resume_btn.click(on_resume, [run_pick], [runs_msg])

        model_pickers = [model_a, model_b, chat_model, qa_model, model, tok_model]

        @_outputs(len(model_pickers) + 1)
        def on_export(name):
            written = runs.export(picked(name))
            now = disk_choices(ws, runs)  # the new folders in every model dropdown, each keeping its pick
            return tuple(gr.update(choices=now[d.elem_id]["choices"]) for d in model_pickers) + (
                "Exported to " + ", ".join(f"**{w}**" for w in written) + ": compare them in the Compare tab, or "
                "chat with them in the Chat tab",
            )

        export_btn.click(on_export, [run_pick], model_pickers + [runs_msg])

        @_outputs(3)
        def on_sweep(folder):
            md, figs = sweep_report(ws, folder)
            return md, figs, ""

        sweep_btn.click(on_sweep, [sweep_pick], [sweep_md, sweep_figs, runs_msg])

        # -------- Compare handler
        def on_compare(a, b, text, n, budget):
            try:
                if not a or not b:
                    raise StudioError("pick two models (export a run first to get its model folder)")
                pa, pb = str(ws.inside(a, "model folder")), str(ws.inside(b, "model folder"))
                for out in compare.side_by_side(pa, pb, text, int(n), budget or None, str(ws.swap)):
                    yield out + ("",)
            except StudioError as e:
                yield "", "", "", "", _error(e)

        cmp_btn.click(
            on_compare, [model_a, model_b, prompt, max_new, cmp_budget], [out_a, out_b, fig_a, fig_b, cmp_msg]
        )

        # -------- Chat handlers
        def conversation_path(name):
            return ws.chats / f"{safe_name(name, 'conversation name')}.json"

        def on_chat(model_choice, name, text, n, budget):
            try:
                if not model_choice:
                    raise StudioError("pick a model folder (an export, or an instruct model under models/)")
                model_path = str(ws.inside(model_choice, "model folder"))
                cleared = False  # the message box empties once, as the turn starts (a later message typed stays)
                path = conversation_path(name)
                started = time.monotonic()
                messages = []
                for messages in chat.turn(model_path, path, text, int(n), budget or None, str(ws.swap)):
                    yield messages, gr.update() if cleared else "", ""
                    cleared = True
                # Said once the turn has ended, and numbered: Send takes a new message only from here on.
                replies = sum(m.get("role") == "assistant" for m in messages)
                yield (
                    messages,
                    gr.update(),
                    f"Reply {replies} of {ws.relative(path)} in {time.monotonic() - started:.1f} s.",
                )
            except StudioError as e:
                yield gr.update(), gr.update(), _error(e)

        # Each Send is a message: one sent while a reply still streams waits for it (Gradio's default for a click
        # drops it while the event before is open, and the message would be lost).
        for trigger in (chat_send.click, chat_text.submit):
            trigger(
                on_chat,
                [chat_model, chat_name, chat_text, chat_new_tokens, chat_budget],
                [chatbot, chat_text, chat_msg],
                trigger_mode="multiple",
            )

        @_outputs(2)
        def on_chat_new(name):
            path = conversation_path(name)
            if path.exists():
                path.unlink()
            return [], f"Started {ws.relative(path)} afresh."

        chat_new.click(on_chat_new, [chat_name], [chatbot, chat_msg])

        @_outputs(2)
        def on_chat_open(name):
            return chat.history(conversation_path(name)), ""

        chat_name.submit(on_chat_open, [chat_name], [chatbot, chat_msg])

        from_disk = [tok_model, qa_model, saved, model, data, run_pick, sweep_pick, model_a, model_b, chat_model]

        def on_load():
            # The page shows the values it was built with: each is kept while it exists (a pick made before
            # this answer comes stays), and replaced when it is gone.
            now = disk_choices(ws, runs)
            updates = []
            for d in from_disk:
                fresh = now[d.elem_id]
                kept = d.value is None or d.value in fresh["choices"]
                updates.append(gr.update(choices=fresh["choices"]) if kept else gr.update(**fresh))
            return tuple(updates)

        page.load(on_load, None, from_disk)
    return page


def active_runs(root: str) -> list[str]:
    runs = Runs(Workspace(root))
    return [n for n in runs.names() if runs.status(n).get("state") in ACTIVE]
