"""`compare --plot FILE` replaces only a picture it drew (issue 45, item 4): a user's
report.pdf at that name used to be overwritten with the learning curves, exit 0. The rule is
`launch slurm --output`'s: a file holding the writer's mark may be replaced, nothing else."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.commands.plots import MARK, MARKED_FORMATS, check_replaceable, learning_curves
from pipeline.errors import PipelineError
from pipeline.training.head_maps import save
from tests.fixtures.tracked_pipeline import pipeline


@pytest.fixture
def store(tracked_cfg, calls, tmp_path, monkeypatch):
    """One tracked pipeline run (stand-in stages) in the file store compare reads."""
    pipeline(tracked_cfg)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    return tmp_path


def compare_plot(path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["compare", "--plot", str(path)])
    return result.exit_code, result.stderr


def test_plot_refuses_to_replace_a_users_file_and_replaces_its_own(store):
    report = store / "report.pdf"
    report.write_bytes(b"%PDF-1.7 the user's report")
    code, err = compare_plot(report)
    assert (code, err) == (
        2,
        f"error: --plot {report}: not a picture allattn-pipe compare --plot drew (no "
        f"{MARK!r} in it); refusing to replace it: name a new file, or remove this one\n",
    )
    assert report.read_bytes() == b"%PDF-1.7 the user's report"
    # refused before the store is read: no table printed above the error
    assert CliRunner().invoke(main, ["compare", "--plot", str(report)]).stdout == ""
    # its own picture it draws again in place
    curves = store / "curves.png"
    for _ in range(2):
        assert compare_plot(curves) == (0, f"learning curves: {curves}\n")
    assert MARK.encode() in curves.read_bytes()


@pytest.mark.parametrize("image", MARKED_FORMATS)
def test_every_format_that_can_carry_the_mark_is_recognised_by_it(tmp_path, image):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / f"curves.{image}"
    for creator in ("someone else", MARK):
        fig = plt.figure(figsize=(1, 1))
        save(fig, path, metadata={"Creator": creator})
        if creator != MARK:
            with pytest.raises(PipelineError, match="not a picture allattn-pipe compare"):
                check_replaceable(path)
    check_replaceable(path)


@pytest.mark.parametrize("kind", ["jpg", "link", "directory"])
def test_what_cannot_carry_the_mark_is_never_replaced(tmp_path, kind):
    path = tmp_path / ("curves.jpg" if kind == "jpg" else "curves.png")
    if kind == "jpg":  # a picture of ours of a format without metadata: drawn once, kept
        learning_curves({}, path)
    elif kind == "link":
        (tmp_path / "target.png").write_bytes(b"theirs")
        path.symlink_to(tmp_path / "target.png")
    else:
        path.mkdir()
    before = path.read_bytes() if kind != "directory" else None
    with pytest.raises(PipelineError, match="refusing to replace it"):
        learning_curves({}, path)
    assert (path.read_bytes() if kind != "directory" else None) == before
