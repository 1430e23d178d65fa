"""Opacus's own conv and ghost-clipping tests, run with convgrad.opacus.register() in effect and without (slow).

Each module of Opacus's shipped test suite below runs twice in a subprocess (plugin: opacus_suite_plugin.py), with
the same hypothesis seed, so both runs draw the same examples: with the registration every test must end as it
does without it, and our conv rule must have run where the module has convolutions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import convgrad

pytest.importorskip("opacus")
pytest.importorskip("hypothesis")

TESTS = Path(__file__).resolve().parent
MODULES = {  # Opacus's test module -> whether its models have convolutions (our rule must run there)
    "opacus.tests.grad_samples.conv1d_test": True,
    "opacus.tests.grad_samples.conv2d_test": True,
    "opacus.tests.grad_samples.conv3d_test": True,
    "opacus.tests.grad_sample_module_fast_gradient_clipping_test": True,  # ghost clipping on SampleConvNet
    "opacus.tests.grad_sample_hooks_fast_gradient_clipping_test": False,  # the ghost hooks, Linear models
}
EXAMPLES = int(os.environ.get("CONVGRAD_OPACUS_EXAMPLES", "20"))  # hypothesis examples per test (Opacus: 100)


def _run(module: str, registered: bool, tmp_path: Path) -> tuple[dict[str, str], int, str]:
    """{test id: passed/failed/error/skipped}, our conv rule's calls, and the output."""
    xml = tmp_path / f"{module}-{int(registered)}.xml"
    src = str(Path(convgrad.__file__).resolve().parents[1])  # this convgrad, not another installed one
    env = {**os.environ, "CONVGRAD_OPACUS_REGISTER": str(int(registered)), "CONVGRAD_OPACUS_EXAMPLES": str(EXAMPLES),
           "PYTHONPATH": os.pathsep.join([str(TESTS), src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "opacus_suite_plugin", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "-o", "addopts=", "-q", "--hypothesis-seed=0", f"--junitxml={xml}",
                           "--pyargs", module], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        outcomes[f"{case.get('classname')}.{case.get('name')}"] = kinds[0] if kinds else "passed"
    calls = re.search(r"convgrad conv rule calls: (\d+)", out)
    assert calls, out[-3000:]
    return outcomes, int(calls[1]), out


@pytest.mark.slow
@pytest.mark.parametrize("module", list(MODULES))
def test_opacus_own_tests_end_alike_with_our_rules_registered(module: str, tmp_path: Path) -> None:
    plain, plain_calls, plain_out = _run(module, False, tmp_path)
    ours, calls, out = _run(module, True, tmp_path)
    assert plain and plain_calls == 0, plain_out[-3000:]
    assert ours == plain, ({k: (plain.get(k), v) for k, v in ours.items() if plain.get(k) != v}, out[-3000:])
    assert (calls > 0) == MODULES[module], calls
    assert all(v in ("passed", "skipped") for v in plain.values()), {k: v for k, v in plain.items() if v != "passed"}
