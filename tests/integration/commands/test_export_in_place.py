"""`export --out DIR` into a directory that exists (issue 45, item 4): the export is written
inside it, which keeps its inode, mode and group, a team's setgid `2770` directory included
(it used to be replaced by a new `0755` directory of the user's group); a half-written export
in it never loads."""

from __future__ import annotations

import errno
import os
import stat

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.commands.export import MARKER, load_exported

TEAM_GID = 4242  # no group of the user's: what a shared project directory is made for


def attributes(path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_ino, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def export(trained, out, *more, code=0) -> str:
    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(out), *more])
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def team_dir(tmp_path):
    """An empty group directory, 2770, of a group the user is not in where the test can give
    it one (as root), else of the user's group."""
    out = tmp_path / "team" / "model"
    out.mkdir(parents=True)
    if os.geteuid() == 0:
        os.chown(out, -1, TEAM_GID)
    os.chmod(out, 0o2770)
    return out


def test_an_existing_group_directory_keeps_its_inode_mode_and_group(trained, team_dir):
    before = attributes(team_dir)
    export(trained, team_dir)
    assert attributes(team_dir) == before
    files = sorted(p.name for p in team_dir.iterdir())
    assert files == [MARKER, "config.json", "model.safetensors", "vocab.json"]
    # made inside the setgid directory: the team's group, as anything made there gets
    assert {os.stat(team_dir / f).st_gid for f in files} == {before[3]}
    # an earlier export replaced: the same directory still, the same files
    export(trained, team_dir, "--format", "hf")
    assert attributes(team_dir) == before
    assert "modeling_allattn_pipe.py" in {p.name for p in team_dir.iterdir()}
    export(trained, team_dir)
    assert attributes(team_dir) == before
    assert sorted(p.name for p in team_dir.iterdir()) == files  # the HF folder's code gone
    load_exported(team_dir)


def test_an_export_cut_short_in_an_existing_directory_never_loads(trained, tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    export(trained, out)
    real_replace = os.replace

    def cut(src, dst, *args, **kwargs):
        if os.path.basename(dst) == "vocab.json":  # half-way through the renames
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", cut)
    output = export(trained, out, code=2)
    assert output == f"error: --out {out}: cannot write the export: Input/output error\n"
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (out / "config.json").exists()  # nothing takes it for a complete export
    with pytest.raises(Exception, match="an export still being written, or killed"):
        load_exported(out)
    # no staging directory left behind; exporting again finishes it
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "model.safetensors", "vocab.json"]
    export(trained, out)
    load_exported(out)
