"""Every public name of the package (`ddiloco.__all__`) is what the docs say it is, whatever was imported before:
`ddiloco.environment()` raised "'module' object is not callable" once anything had imported the submodule of the
same name (`from ddiloco import session` does), since importing a submodule sets the package's attribute."""

import subprocess
import sys

import pytest

import ddiloco

SCRIPT = """
import ddiloco
from ddiloco import session  # imports ddiloco.environment (the module) on the way
import ddiloco.environment
assert callable(ddiloco.environment), type(ddiloco.environment)
assert ddiloco.environment.__name__ == "environment"
print(type(ddiloco.environment()).__name__)
"""


def test_environment_stays_the_function_after_its_module_is_imported():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "LearnerEnvironment"


@pytest.mark.parametrize("name", ddiloco.__all__)
def test_every_public_name_is_a_class_or_function(name):
    assert callable(getattr(ddiloco, name)), name
