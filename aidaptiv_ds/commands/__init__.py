"""The ``aidaptiv-ds`` commands, one module each (``aidaptiv_ds.cli`` dispatches here): each parses its flags
(the shared ones from :mod:`aidaptiv_ds.commands.flags`), makes its library call, and turns the outcome into one
line and an exit status. Nothing below this package imports argparse or names a flag."""
