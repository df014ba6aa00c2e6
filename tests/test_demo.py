"""The README's main job runs end to end (its own checks make it return non-zero on a mismatch)."""
from radixkv.cli import main


def test_demo_walkthrough_runs_and_verifies(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "conservation holds" in out
    assert "they hold its prompt tokens" in out
