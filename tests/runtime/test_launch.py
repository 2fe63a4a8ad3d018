"""Per-rank device assignment and the environments a multi-host run is started from (no GPU needed)."""

import pytest

from zinfjax.errors import UserError
from zinfjax.runtime.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID, with_torchrun_names
from zinfjax.runtime.launch import gpus_of_rank, process_env


def test_each_rank_gets_its_own_equal_share_of_the_hosts_gpus():
    base = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    shares = [process_env(r, 4, "127.0.0.1:1", base=base)["CUDA_VISIBLE_DEVICES"] for r in range(4)]
    assert shares == ["0,1", "2,3", "4,5", "6,7"]


def test_a_host_without_gpus_assigns_none():
    env = process_env(0, 2, "127.0.0.1:1", devices_per_process=2, base={"CUDA_VISIBLE_DEVICES": ""})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["ZINFJAX_LOCAL_DEVICES"] == "2"


def test_gpus_that_do_not_divide_among_the_ranks_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"^-n 3 processes cannot share the 4 GPUs of this host") as err:
        gpus_of_rank(0, 3, ["0", "1", "2", "3"])
    assert "\n" not in str(err.value)


def test_torchrun_variables_name_the_run_when_zinfjax_ones_are_absent():
    torch_env = {"WORLD_SIZE": "8", "RANK": "5", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    env = with_torchrun_names(torch_env)
    assert (env[NUM_PROCESSES], env[PROCESS_ID], env[COORDINATOR]) == ("8", "5", "node0:29500")
    ours = {**torch_env, NUM_PROCESSES: "2", PROCESS_ID: "0", COORDINATOR: "h:1"}
    assert with_torchrun_names(ours) is ours  # zinfjax's own variables win
