import sys
from pathlib import Path

# the tests import their one helper module as `helpers`
sys.path.insert(0, str(Path(__file__).parent))
