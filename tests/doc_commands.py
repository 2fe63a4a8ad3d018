"""Each command README.md and docs/*.md show a user, and the test that runs it (tests/test_docs.py checks the table).

The key is the command as `tests.test_docs.doc_commands` normalizes it: its lines joined, its comment dropped, its
white space single. A test runs a command when it gives the same program and subcommand the same options and
``--set`` keys; the values may differ (paths under the test's directory, smaller models, sizes and step counts), and
it may add keys of its own (``steps``, ``seq_len``, ``log``). A command that no test can run (a real NVMe mount, a
large model, minutes of measuring, a second host) is not listed here: the doc marks it illustrative instead.
"""

FINETUNE = "tests/journeys/test_finetune.py::"
SCRATCH = "tests/journeys/test_from_scratch.py::"
PLANNER = "tests/journeys/test_planner.py::"
DEEPSPEED = "tests/journeys/test_deepspeed_user.py::test_a_deepspeed_run_converts_trains_on_and_exports_to_transformers"
DEMO = SCRATCH + "test_the_demo_trains_on_nvme_and_resumes_at_stage_3_tensor_parallel"
GENERATE = SCRATCH + "test_generate_streams_the_parameters_from_nvme"
EVALUATE = SCRATCH + "test_evaluate_streams_the_parameters_from_nvme"
CKPT_INFO = SCRATCH + "test_ckpt_info_and_verify_name_both_checkpoints"
CONVERT = FINETUNE + "test_convert_keeps_the_tokenizer_and_train_takes_the_plans_placement"
TO_HF = FINETUNE + "test_the_fine_tune_evaluates_and_generates_text_as_transformers_does"
LORA = FINETUNE + "test_lora_on_the_converted_model_evaluates_and_generates_text"
EXPORT_LORA = FINETUNE + "test_the_adapters_export_to_peft_and_merged_to_hf_as_zinfjax_generates"
LAUNCH = "tests/runtime/test_multiprocess.py::test_reference_two_processes_match_one_process"
SOAK = "tests/benchmarks/test_soak.py::test_gpt2_mini_for_2000_steps_uncapped_and_in_1_GiB_meets_every_target"

RUN_BY = {
    # README.md
    "make demo": DEMO,
    ".venv/bin/zinfjax train --help": "tests/test_cli.py::test_help_explains_every_option",
    ".venv/bin/zinfjax train examples/demo.yaml --set steps=20 --set model=llama-tiny": DEMO,
    ".venv/bin/zinfjax train ds_config.json": DEEPSPEED,
    ".venv/bin/zinfjax train examples/demo.yaml --set stage=3 --set mesh=data:4,model:2": DEMO,
    ".venv/bin/zinfjax launch -n 2 --devices-per-process 2 -- .venv/bin/zinfjax train examples/demo.yaml": LAUNCH,
    ".venv/bin/zinfjax train examples/demo.yaml --set tiers=auto --set nvme_path=/mnt/nvme/run":
        PLANNER + "test_tiers_auto_trains_the_demo_with_the_placement_it_prints",
    ".venv/bin/zinfjax plan --machine examples/machines/dgx2-v100.yaml "
    "--set model=examples/models/zero-infinity-1t.yaml --set precision=fp16 --set stage=3 --set micro_batch_size=2 "
    "--set batch_size=0 --set seq_len=1024":
        PLANNER + "test_the_readmes_plan_holds_the_1t_model_on_one_dgx2_only_with_nvme",
    ".venv/bin/zinfjax bench io --dir /mnt/nvme/bench --bytes 2GiB":
        "tests/benchmarks/test_io.py::test_io_bench_cli_prints_json",
    ".venv/bin/zinfjax bench versus-deepspeed --dir /mnt/nvme/vds":
        "tests/benchmarks/test_versus_deepspeed.py::test_without_deepspeed_the_zinfjax_side_runs",
    ".venv/bin/zinfjax train examples/demo.yaml --set save_dir=runs/ckpt --set save_every=20": DEMO,
    ".venv/bin/zinfjax train examples/demo.yaml --set save_dir=runs/ckpt --set resume=true --set stage=3": DEMO,
    ".venv/bin/zinfjax ckpt info runs/ckpt": CKPT_INFO,
    ".venv/bin/zinfjax ckpt info runs/ckpt --verify": CKPT_INFO,
    '.venv/bin/zinfjax generate runs/ckpt --prompt "The " --set params=nvme --set nvme_path=/mnt/nvme/gen': GENERATE,
    ".venv/bin/zinfjax evaluate runs/ckpt --data demo --set params=nvme --set nvme_path=/mnt/nvme/gen": EVALUATE,
    ".venv/bin/zinfjax convert path/to/hf-model runs/model": CONVERT,
    ".venv/bin/zinfjax convert runs/model out/hf --to hf": TO_HF,
    ".venv/bin/python examples/finetune_hf.py":
        "tests/interop/test_convert.py::test_the_example_fine_tunes_a_converted_model_and_transformers_scores_it_better",
    # docs/BENCHMARKS.md
    ".venv/bin/pytest -q tests/engine/test_host_update.py":
        "tests/engine/test_host_update.py::test_the_update_on_the_host_is_bitwise_the_update_on_the_device",
    ".venv/bin/python bench/gpu.py --platform cpu --model gpt2-tiny --batch-size 2 --seq-len 16 --grad-accum 1 "
    "--steps 3 --update-on host":
        "tests/benchmarks/test_gpu.py::test_the_dry_run_with_the_update_on_the_host_moves_gradients_and_parameters_only",
    "zinfjax bench soak --dir /work/runs/soak --steps 2000 --memory-limits none,1GiB -o /work/runs/soak/soak.png": SOAK,
    "zinfjax bench soak --dir /work/runs/soak2 --steps 2000 --memory-limits none -o /work/runs/soak2/soak.png": SOAK,
    # docs/inference.md
    "zinfjax evaluate runs/ckpt --data demo --set params=nvme --set nvme_path=/mnt/nvme/eval": EVALUATE,
    'zinfjax generate runs/ckpt --prompt "The " --max-new-tokens 40 --set params=nvme --set nvme_path=/mnt/nvme/gen':
        GENERATE,
    "zinfjax generate runs/ckpt --prompt-ids 1,2,3 --batch-size 64 --json --temperature 0.8 --top-k 50 --top-p 0.95 "
    "--seed 1 --set params=nvme --set kv_cache=host --set nvme_path=/mnt/nvme/gen": GENERATE,
    # docs/interop.md
    "zinfjax convert path/to/gpt2 runs/gpt2": CONVERT,
    "zinfjax convert ds_run/ runs/from-ds": DEEPSPEED,
    "zinfjax convert ckpt.pt runs/nano --model model.json --mapping examples/mapping_nanogpt.yaml":
        "tests/interop/test_convert.py::test_a_state_dict_converts_by_hf_names_or_by_a_mapping",
    "zinfjax convert runs/gpt2 out/gpt2-hf --to hf --dtype bf16":
        "tests/interop/test_convert.py::test_hf_to_hf_in_another_dtype",
    "zinfjax train --set model=runs/gpt2 --set save_dir=runs/gpt2 --set resume=true --set data=notes.jsonl "
    "--set params=nvme --set optimizer=nvme --set nvme_path=/mnt/nvme/gpt2":
        "tests/interop/test_convert.py::test_zinfjax_train_continues_a_converted_model_from_its_checkpoint",
    "zinfjax convert runs/gpt2 out/gpt2-finetuned --to hf": TO_HF,
    "zinfjax convert path/to/llama runs/llama": CONVERT,
    "zinfjax train --set model=runs/llama --set lora_rank=16 --set lora_targets=q,v --set save_dir=runs/lora ...": LORA,
    "zinfjax convert runs/lora out/adapter --to peft": EXPORT_LORA,
    "zinfjax convert runs/lora out/merged --to hf --merge": EXPORT_LORA,
    "zinfjax convert out/adapter runs/lora2 --base runs/llama":
        "tests/interop/test_peft.py::test_a_peft_adapter_converts_onto_its_base_with_peft_logits",
    # docs/sharding.md
    "zinfjax train examples/demo.yaml --set stage=3 --set mesh=data:4,model:2": DEMO,
    "zinfjax launch -n 2 --devices-per-process 2 -- zinfjax train examples/demo.yaml --set mesh=data:4": LAUNCH,
}
