""".ci/coverage_ratio.py: the fast tier's share of the whole suite's covered lines, on data files made here."""

from __future__ import annotations

from pathlib import Path

import pytest
from coverage import CoverageData

from helpers import load_script

ratio = load_script("coverage_ratio", Path(__file__).resolve().parents[1] / ".ci" / "coverage_ratio.py")


def _data(path: Path, root: str, lines: dict[str, range]) -> str:
    data = CoverageData(basename=str(path))
    data.add_lines({f"{root}/convgrad/{name}": list(numbers) for name, numbers in lines.items()})
    data.write()
    return str(path)


def test_the_share_unites_the_whole_suites_files_across_checkouts(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fast = _data(tmp_path / "fast", "/a/src", {"spec.py": range(1, 20)})  # 19 lines
    slow = _data(tmp_path / "slow", "/b/src", {"spec.py": range(10, 21), "cli.py": range(1, 1001)})
    assert ratio.main(["--fast", fast, "--whole", slow]) == 1  # 19 of 1,020
    out = capsys.readouterr().out
    assert "whole suite: 1020; by the fast tier: 19 (1.9%)" in out and "1000 lines of convgrad/cli.py" in out
    more = _data(tmp_path / "more", "/c/src", {"cli.py": range(1, 1001)})
    assert ratio.main(["--fast", fast, more, "--whole", slow]) == 0  # 1,019 of 1,020
    assert "(99.9%)" in capsys.readouterr().out


def test_an_empty_data_file_is_an_error(tmp_path: Path) -> None:
    empty = _data(tmp_path / "empty", "/a/src", {})
    with pytest.raises(SystemExit, match="holds no measured files"):
        ratio.main(["--fast", empty, "--whole", empty])
