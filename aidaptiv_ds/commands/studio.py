"""The whole fine-tuning workflow in a browser: documents to a data set, plan and train, curves, compare.

  aidaptiv-ds studio                                  # http://127.0.0.1:7860, files under ./studio
  aidaptiv-ds studio --root /data/studio --port 8080
  AIDAPTIV_STUDIO_PASSWORD=... aidaptiv-ds studio --host 0.0.0.0

A local web app (Gradio) that drives the product only through its commands (`plan`, `train`, `export`,
`generate`, `report`) and the files they write, under --root. It listens on localhost unless --host says
otherwise; any other address needs a password (AIDAPTIV_STUDIO_PASSWORD or --password-file), since whoever
reaches the page can start processes and read the root. On loopback it answers only requests for localhost
or a loopback address, and never a request from another site's page (aidaptiv_ds.studio.server). Training
runs are processes of their own: closing the page or stopping the studio leaves them running, and the studio
finds them again from their folders; what it starts for a request (generate, plan, export) ends with it.
"""

from __future__ import annotations

import os
import sys

HELP_EPILOG = (
    "exit codes:\n  0  stopped by the user\n  1  refused (an address without a password, a bad --root, the port taken, "
    "the studio's packages not installed: pip install 'aidaptiv-ds[studio]')"
)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; ::1 and localhost too; any other "
        "address needs a password)",
    )
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    parser.add_argument(
        "--root", default="studio", help="folder for uploads, data sets, runs and models (default ./studio)"
    )
    parser.add_argument(
        "--password-file",
        metavar="FILE",
        help="a file holding the password (needed when --host is not a loopback address; or set "
        "AIDAPTIV_STUDIO_PASSWORD)",
    )
    parser.add_argument("--max-upload", default="200MB", help="largest file an upload may be (default 200MB)")


def password_for(args) -> str | None:
    if args.password_file:
        with open(args.password_file, encoding="utf-8") as fh:
            return fh.read().strip() or None
    return os.environ.get("AIDAPTIV_STUDIO_PASSWORD") or None


def run(args) -> int:
    from aidaptiv_ds.common.extras import STUDIO, missing, missing_message
    from aidaptiv_ds.studio.server import is_loopback

    absent = missing(*STUDIO)
    if absent:  # a training node installs the core only
        print(f"aidaptiv-ds studio: {missing_message('the studio', absent)}", file=sys.stderr)
        return 1
    try:
        password = password_for(args)
    except OSError as e:
        print(f"aidaptiv-ds studio: cannot read --password-file {args.password_file}: {e.strerror}", file=sys.stderr)
        return 1
    root = os.path.abspath(args.root)
    try:
        os.makedirs(root, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        print(
            f"aidaptiv-ds studio: cannot use --root {root}: {e.strerror}; choose a folder this user can write",
            file=sys.stderr,
        )
        return 1
    if not is_loopback(args.host) and not password:
        print(
            f"aidaptiv-ds studio: refusing to listen on {args.host} without a password: whoever reaches the page "
            "can start training processes and read every file under --root. Set AIDAPTIV_STUDIO_PASSWORD (or "
            "--password-file FILE), or keep the default --host 127.0.0.1 and reach it through an SSH tunnel.",
            file=sys.stderr,
        )
        return 1
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    # Uploads land under the root too (Gradio's default is /tmp/gradio), before the page copies them to uploads/.
    os.environ["GRADIO_TEMP_DIR"] = os.path.join(os.path.abspath(args.root), "uploads", ".incoming")
    from aidaptiv_ds.studio.app import active_runs, build

    page = build(args.root)
    running = active_runs(args.root)
    print(f"aidaptiv-ds studio: root {root}" + (f"; re-attached to running: {', '.join(running)}" if running else ""))
    auth = None
    if password:
        import hmac

        def auth(_user: str, given: str) -> bool:
            return hmac.compare_digest(given.encode(), password.encode())

    page.queue(default_concurrency_limit=4)
    from aidaptiv_ds.studio.server import CannotListen, serve

    try:
        serve(
            page,
            host=args.host,
            port=args.port,
            auth=auth,
            auth_message="aidaptiv-ds studio: any user name, the password it was started with",
            max_file_size=args.max_upload,
            allowed_paths=[root],
        )
    except CannotListen as e:  # the port taken, an address this machine does not have
        print(f"aidaptiv-ds studio: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C again once it has shut down
        pass
    return 0
