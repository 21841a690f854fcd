"""Run `allattn-pipe run CONFIG` in this process; when train is about to write checkpoint
step AT, its checkpoints directory becomes read-only (a read-only bind mount: run this under
`unshare -m` as root), as a file system remounted read-only under a running job does."""

from __future__ import annotations

import subprocess
import sys

from pipeline.training import checkpoint_io


def main(config: str, at: int) -> None:
    write = checkpoint_io.CheckpointIO._write

    def turn_read_only(self, root, tag, loop):
        if loop.step == at:
            subprocess.run(["mount", "--bind", "-o", "ro", str(root), str(root)], check=True)
        return write(self, root, tag, loop)

    checkpoint_io.CheckpointIO._write = turn_read_only
    from pipeline.commands.cli import main as cli

    cli(["run", config], prog_name="allattn-pipe")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
