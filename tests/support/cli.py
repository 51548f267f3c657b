"""What the command line's tests share: ``graphcap ARGV`` run in this process, and the one
line it writes when it refuses its arguments."""

from __future__ import annotations

from graphcap.cli import main


def cli(capsys, *argv):
    """``graphcap ARGV`` in this process: its exit status, stdout and stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's exits: --help, --version, a refused argument
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv) -> str:
    """The one line ``graphcap ARGV`` writes to stderr, having exited 2."""
    code, _, err = cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err
