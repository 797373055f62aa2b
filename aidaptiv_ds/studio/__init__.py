"""The studio: `aidaptiv-ds studio`, the fine-tuning workflow in a browser (documents to a data set, plan,
train with live curves, stop and resume, export, two models side by side, runs and sweeps).

It sits on top of the product and drives it as a user would, through `aidaptiv-ds` processes and the files
they write (plan's JSON and config, train's CSV monitor, metrics and checkpoints, export's folders,
generate's streamed text), so a run it starts is an ordinary run. workspace: the root and its path gate;
documents: files to text and passages; data_sets: records as table rows and JSONL; qa: question/answer records
by a local model; runs: launch, stop, resume, export, curves; supervise: the detached process per attempt;
compare: two generate processes side by side; chat: a conversation, one generate process a turn; children:
how those processes end with the studio; views: what the page shows from the disk; app: the page; server: who may talk to it (Host and Origin checks) and how it is served; command: the CLI.
"""
