"""Context parallelism across processes: 2 processes x 2 CPU devices over gloo on loopback."""

from . import _processes


def test_two_processes_cp4_matches_single_device(tmp_path):
    _processes.run_workers("_multiprocess_worker", 2, str(tmp_path), devices=2)
    outs = [tmp_path / f"out{i}.txt" for i in range(2)]
    for out in outs:
        cp, nprocs, err_o, err_h = out.read_text().split()
        assert (int(cp), int(nprocs)) == (4, 2)
        assert float(err_o) <= 1e-5
        assert float(err_h) <= 1e-5
