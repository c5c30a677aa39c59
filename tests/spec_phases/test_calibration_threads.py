"""First-start calibration runs its small ops on one CPU thread, restored afterwards (also when it
fails)."""
import pytest
import torch

from specserve.spec_phases.calibration import calibration_threads


def test_calibration_runs_on_one_thread_and_restores_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with calibration_threads("cpu"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            with calibration_threads("cpu"):
                raise RuntimeError("calibration failed")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
