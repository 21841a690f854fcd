"""An export removes the partial directories an earlier export left (kill -9, a second
signal) only where it can prove them abandoned and its own: an export's name, a directory
owned by this user, its lock file there and held by no process. A live export's, another
user's and one without its lock file (an older version's) stay as they are.
tests/system/commands/test_export_signals.py makes the leftover with a real kill -9."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.commands.export_dirs import PARTIAL, make_claimed, partial_name, release

NOBODY = 65534


def partial(parent, name: str, held: bool = False):
    """A partial export directory with weights in it; its lock released unless `held`."""
    directory, lock = make_claimed(parent, name)
    (directory / "model.safetensors").write_bytes(b"partial weights")
    if not held:
        release(lock)
    return directory


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def export(trained, out) -> None:
    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(out)])
    assert result.exit_code == 0, result.output


def test_only_abandoned_partial_directories_of_this_user_are_removed(trained, tmp_path):
    exports = tmp_path / "exports"
    exports.mkdir()
    abandoned = partial(exports, partial_name("model"))
    of_another_target = partial(exports, partial_name("other"))
    live = partial(exports, partial_name("model"), held=True)
    unlocked = exports / f".model.{PARTIAL}.a1b2c3d4.tmp"  # no lock file: not provably ours
    unlocked.mkdir()
    older = exports / ".model.a1b2c3d4.tmp"  # an older version's name, or anyone's
    older.mkdir()
    kept = [live.name, unlocked.name, older.name]
    if os.geteuid() == 0:  # another user's, abandoned: only root can make one here
        theirs = partial(exports, partial_name("model"))
        os.chown(theirs, NOBODY, NOBODY)
        kept.append(theirs.name)
    export(trained, exports / "model")
    assert names(exports) == sorted([*kept, "model"])
    assert not abandoned.exists() and not of_another_target.exists()
    assert names(live) == [".allattn-export.lock", "model.safetensors"]


@pytest.mark.parametrize("held", [False, True])
def test_staging_inside_an_earlier_export_is_removed_only_when_abandoned(trained, tmp_path, held):
    out = tmp_path / "model"
    export(trained, out)
    staging = partial(out, "allattn-export-staging", held=held)
    export(trained, out)
    assert staging.exists() == held
