"""Params resolution: presets, overrides, aliases, and errors that name the key."""

import pytest

from simdist.config import ConfigError, batch_sizes, load_params, parse_overrides


def test_default_preset_loads():
    p = load_params([])
    assert p.model.name == "fc_mnist"
    assert p.model.hidden_sizes == [512, 512]
    assert p.runconfig.zero_opt_level == 0
    assert p.train_input.batch_size == 32


def test_overrides_and_types():
    p = load_params(
        [
            "--runconfig.max_steps=50",
            "--runconfig.model_dir",
            "out",
            "--model.hidden_sizes=[64]",
            "--optimizer.learning_rate=1e-2",
            "--optimizer.max_gradient_norm=1",
        ]
    )
    assert p.runconfig.max_steps == 50
    assert p.runconfig.model_dir == "out"
    assert p.model.hidden_sizes == [64]
    assert p.optimizer.learning_rate == pytest.approx(0.01)
    assert p.optimizer.max_gradient_norm == 1.0 and isinstance(p.optimizer.max_gradient_norm, float)


def test_flag_aliases():
    p = load_params(["--zero_opt_level", "2", "--multireplica", "--mode=train", "-ws", "2"])
    assert p.runconfig.zero_opt_level == 2
    assert p.runconfig.enable_data_parallel is True
    assert p.runconfig.mode == "train"
    assert p.runconfig.min_world_size == 2
    assert load_params(["--data-parallel"]).runconfig.enable_data_parallel is True


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--runconfig.max_step=5"], "unknown key runconfig.max_step"),
        (["--runconfig.max_steps=five"], "runconfig.max_steps: expected an integer"),
        (["--runconfig.max_steps=2.5"], "runconfig.max_steps: expected an integer"),
        (["--optimizer.learning_rate=fast"], "optimizer.learning_rate: expected a number"),
        (["--runconfig.autoload=3"], "runconfig.autoload: expected true or false"),
        (["--model.hidden_sizes=[a]"], "model.hidden_sizes[0]: expected an integer"),
        (["--zero_opt_level", "4"], "zero_opt_level must be 0, 1, 2 or 3"),
        (["--runconfig.mode=fly"], "runconfig.mode: 'fly' is not one of"),
        (["--bogus"], "unrecognised argument '--bogus'"),
        (["--params", "no_such_preset"], "neither a file nor a preset"),
        (["--nosection.key=1"], "--nosection.key"),
        (["--train_input.global_batch_size=64"], "exactly one of batch_size"),
        (["--model.name=resnet"], "model.name: unknown model 'resnet'"),
        (["--optimizer.learning_rate=-1"], "optimizer.learning_rate: must be a finite number > 0"),
        (["--runconfig.ranks_per_node=0"], "runconfig.ranks_per_node must be >= 1"),
        (["--runconfig.collective_algorithm=tree"], "is not one of"),
        (
            ["--runconfig.ranks_per_node=2", "--runconfig.execution_mode=weight_streaming"],
            "applies to pipelined execution only",
        ),
    ],
)
def test_errors_name_the_key(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_params(argv)
    assert needle in str(e.value)


def test_params_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("runconfig: {max_steps: [1,\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_params(["--params", str(bad)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("runconfg:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="unknown section 'runconfg'"):
        load_params(["--params", str(unknown)])
    with pytest.raises(ConfigError, match="does not exist"):
        load_params(["--params", str(tmp_path / "missing.yaml")])


def test_params_file_with_overrides(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("runconfig:\n  max_steps: 7\noptimizer:\n  optimizer_type: sgd\n")
    p = load_params(["--params", str(f), "--runconfig.seed=5"])
    assert (p.runconfig.max_steps, p.runconfig.seed, p.optimizer.optimizer_type) == (7, 5, "sgd")


def test_batch_sizes_per_replica_and_global():
    p = load_params([])
    assert batch_sizes(p, 4) == (32, 128)
    g = load_params(["--train_input.batch_size=null", "--train_input.global_batch_size=96"])
    assert batch_sizes(g, 3) == (32, 96)
    with pytest.raises(ConfigError, match="not divisible"):
        batch_sizes(g, 5)
    acc = load_params(["--optimizer.grad_accum_steps=2"])
    assert batch_sizes(acc, 2) == (32, 128)


def test_parse_overrides_values_are_yaml():
    _, o = parse_overrides(["--runconfig.checkpoint_path=null", "--model.hidden_sizes=[1, 2]"])
    assert o == {"runconfig.checkpoint_path": None, "model.hidden_sizes": [1, 2]}


# ---------------------------------------------------------------- inputs that used to slip


def _file(tmp_path, text: str, name: str = "p.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize(
    "text, line, key",
    [
        ("runconfig:\n  max_steps: 5\n  seed: 2\n  max_steps: 9\n", 4, "runconfig.max_steps"),
        ("optimizer: {beta1: 0.9, beta1: 0.8}\n", 1, "optimizer.beta1"),
        ("runconfig:\n  seed: 1\nrunconfig:\n  seed: 2\n", 3, "runconfig"),
        (
            "optimizer:\n  learning_rate:\n    - scheduler: Constant\n"
            "      learning_rate: 0.1\n      learning_rate: 0.2\n",
            5,
            "optimizer.learning_rate[0].learning_rate",
        ),
    ],
)
def test_duplicate_key_names_file_line_and_key(tmp_path, text, line, key):
    f = _file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_params(["--params", str(f)])
    assert str(e.value).startswith(f"{f}:{line}: duplicate key {key} (first given on line ")


def test_same_key_in_different_sections_is_no_duplicate(tmp_path):
    f = _file(tmp_path, "train_input:\n  batch_size: 8\neval_input:\n  batch_size: 8\n")
    p = load_params(["--params", str(f)])
    assert p.train_input.batch_size == p.eval_input.batch_size == 8


@pytest.mark.parametrize("value", ["-0.1", ".nan", "nan", ".inf", "-.inf", "0"])
def test_bad_learning_rate_in_a_file_names_file_line_and_key(tmp_path, value):
    f = _file(tmp_path, f"runconfig:\n  max_steps: 3\noptimizer:\n  learning_rate: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_params(["--params", str(f)])
    msg = str(e.value)
    assert msg.startswith(f"{f}:4: optimizer.learning_rate"), msg
    assert "finite" in msg


def test_bad_learning_rate_in_a_schedule_names_its_line(tmp_path):
    f = _file(
        tmp_path,
        "optimizer:\n  learning_rate:\n    - scheduler: Linear\n"
        "      initial_learning_rate: -1\n      end_learning_rate: 0.1\n      total_iters: 5\n"
        "    - {scheduler: Constant, learning_rate: .nan}\n",
    )
    with pytest.raises(ConfigError) as e:
        load_params(["--params", str(f)])
    assert str(e.value).startswith(f"{f}:4: optimizer.learning_rate[0].initial_learning_rate")


@pytest.mark.parametrize("value", ["-1", ".nan", "inf", "-inf"])
def test_bad_learning_rate_override_names_the_flag(tmp_path, value):
    f = _file(tmp_path, "optimizer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_params(["--params", str(f), f"--optimizer.learning_rate={value}"])
    msg = str(e.value)
    assert msg.startswith("optimizer.learning_rate") and "finite" in msg, msg
    assert msg.endswith(f"(from --optimizer.learning_rate={value})"), msg


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("optimizer.beta1", "1.0", "optimizer.beta1 must be in [0, 1), got 1.0"),
        ("optimizer.beta2", "-0.5", "optimizer.beta2 must be in [0, 1)"),
        ("optimizer.eps", "0", "optimizer.eps must be > 0"),
        ("optimizer.momentum", "1.5", "optimizer.momentum must be in [0, 1)"),
        ("optimizer.weight_decay", "-1e-4", "optimizer.weight_decay must be >= 0"),
        ("optimizer.weight_decay", ".nan", "optimizer.weight_decay must be a finite number"),
        ("optimizer.max_gradient_norm", "0", "optimizer.max_gradient_norm must be > 0"),
        ("optimizer.grad_accum_steps", "0", "optimizer.grad_accum_steps must be >= 1"),
        ("optimizer.warmup_steps", "-2", "optimizer.warmup_steps must be >= 0"),
        ("train_input.batch_size", "0", "train_input.batch_size must be >= 1"),
        ("eval_input.batch_size", "-4", "eval_input.batch_size must be >= 1"),
        ("train_input.data_dir", "''", "train_input.data_dir must be a non-empty path"),
        ("runconfig.max_steps", "-1", "runconfig.max_steps must be >= 0"),
        ("runconfig.max_steps", "1e30", "runconfig.max_steps: expected an integer"),
        ("runconfig.max_steps", str(2**64), "does not fit in a 64-bit integer"),
        ("runconfig.save_summary_steps", "0", "runconfig.save_summary_steps must be >= 1"),
        ("runconfig.save_checkpoints_steps", "-5", "save_checkpoints_steps must be >= 0"),
        ("runconfig.keep_checkpoint_max", "-1", "runconfig.keep_checkpoint_max must be >= 0"),
        ("runconfig.seed", "-1", "runconfig.seed must be >= 0"),
        ("runconfig.model_dir", "''", "runconfig.model_dir must be a non-empty path"),
        ("runconfig.min_world_size", "0", "runconfig.min_world_size must be >= 1"),
        ("runconfig.stall_timeout_s", ".inf", "runconfig.stall_timeout_s must be a finite"),
        ("runconfig.trace_steps", "-1", "runconfig.trace_steps must be >= 0"),
        ("runconfig.input_workers_per_replica", "-1", "input_workers_per_replica must be >= 0"),
        ("model.hidden_sizes", "[]", "model.hidden_sizes must be a non-empty list"),
        ("model.hidden_sizes", "[64, 0]", "model.hidden_sizes must be a non-empty list"),
        ("model.num_classes", "1", "model.num_classes must be >= 2"),
    ],
)
def test_every_rule_names_the_key_and_the_flag(key, value, needle):
    with pytest.raises(ConfigError) as e:
        load_params([f"--{key}={value}"])
    assert needle in str(e.value), str(e.value)
    assert str(e.value).endswith(f"(from --{key}={value})"), str(e.value)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--execution_mode=weight_streaming", "--weight_servers=0"],
            "weight_servers must be >= 1",
        ),
        (
            ["--execution_mode=weight_streaming", "--prefetch_depth=-1"],
            "prefetch_depth must be >= 0",
        ),
        (["--weight_servers=2"], "runconfig.weight_servers applies to execution_mode weight_str"),
        (["--prefetch_depth=3"], "runconfig.prefetch_depth applies to execution_mode weight_str"),
        (["--execution_mode=weight_streaming", "--zero_opt_level=1"], "applies to pipelined"),
        (["--zero_opt_level=1", "--runconfig.enable_data_parallel=false"], "needs runconfig.enab"),
        (["--params", "gpt2_mini", "--model.n_head=0"], "model.n_head must be >= 1"),
        (
            ["--params", "gpt2_mini", "--model.n_embd=10", "--model.n_head=3"],
            "divisible by model.n_",
        ),
    ],
)
def test_cross_key_rules(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_params(argv)
    assert needle in str(e.value), str(e.value)


def test_rule_from_a_file_names_its_line(tmp_path):
    f = _file(tmp_path, "runconfig:\n  max_steps: 3\n\n  keep_checkpoint_max: -2\n")
    with pytest.raises(ConfigError) as e:
        load_params(["--params", str(f)])
    assert str(e.value) == f"{f}:4: runconfig.keep_checkpoint_max must be >= 0, got -2"


def test_every_preset_passes_the_rules():
    from simdist.config import preset_names

    for name in preset_names():
        load_params(["--params", name])


def test_an_unknown_model_preset_is_reported_where_it_was_written(tmp_path):
    """model.preset is checked with the other keys, so its error names the file's line or
    the flag; the names checked are the models' own presets."""
    from simdist.config import PRESET_NAMES
    from simdist.models import bert_shapes, gpt2, t5_shapes, transformer_shapes

    for model, module in (
        ("gpt2", gpt2),
        ("bert", bert_shapes),
        ("t5", t5_shapes),
        ("transformer", transformer_shapes),
    ):
        assert PRESET_NAMES[model] == tuple(module.PRESETS), model
    f = tmp_path / "p.yaml"
    f.write_text("model:\n  name: gpt2\n  preset: gpt2-mni\n")
    with pytest.raises(ConfigError) as e:
        load_params(["--params", str(f)])
    assert str(e.value).startswith(f"{f}:3: model.preset: unknown 'gpt2-mni' for model gpt2")
    with pytest.raises(ConfigError) as e:
        load_params(["--params", "t5_mini", "--model.preset=t5-large"])
    assert "choose from t5-mini, t5-small, t5-base" in str(e.value)
    assert str(e.value).endswith("(from --model.preset=t5-large)")


def test_train_help_lists_every_flag_and_key(capsys):
    from simdist.config import FLAG_ALIASES, SECTIONS
    from simdist.train import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: mpiexec -n N python -m simdist.train")
    assert all(flag in text for flag in FLAG_ALIASES)
    for section, cls in SECTIONS.items():
        for name in cls.__dataclass_fields__:
            assert f"  {section}.{name} " in text, f"{section}.{name}"


def test_readme_lists_every_key_with_its_rule():
    from pathlib import Path

    from simdist.config import SECTIONS, key_table

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert key_table() in readme, "README's key table is stale: paste key_table()'s output"
    for section, cls in SECTIONS.items():
        for name in cls.__dataclass_fields__:
            assert f"`{section}.{name}`" in key_table()


def test_bad_inputs_end_to_end_exit_2_one_message_nothing_written(tmp_path):
    """Through simdist.train on 2 MPI ranks (tests/mpi/bad_inputs.py runs every case in one
    job): exit 2, one "simdist: error:" line naming file:line or the flag, no model_dir."""
    import json
    import subprocess
    import sys

    from mpi_launch import REPO, mpiexec

    dup = _file(tmp_path, "runconfig:\n  max_steps: 5\noptimizer:\n  beta1: 0.9\n  beta1: 0.8\n")
    lr = _file(
        tmp_path, "runconfig:\n  max_steps: 5\noptimizer:\n  learning_rate: -0.5\n", "l.yaml"
    )
    nan = _file(tmp_path, "optimizer:\n  learning_rate: .nan\n", "n.yaml")
    cases = {
        "duplicate key": (["--params", str(dup)], f"{dup}:5: duplicate key optimizer.beta1"),
        "negative lr in a file": (["--params", str(lr)], f"{lr}:4: optimizer.learning_rate"),
        "nan lr in a file": (["--params", str(nan)], f"{nan}:2: optimizer.learning_rate must be"),
        "inf lr flag": (
            ["--optimizer.learning_rate=inf"],
            "optimizer.learning_rate must be a finite number, got inf "
            "(from --optimizer.learning_rate=inf)",
        ),
        "beta2": (["--optimizer.beta2=1"], "optimizer.beta2 must be in [0, 1), got 1.0"),
        "seed": (["--runconfig.seed=-3"], "runconfig.seed must be >= 0, got -3"),
        "keep": (["--runconfig.keep_checkpoint_max=-1"], "keep_checkpoint_max must be >= 0"),
        "weight servers in pipelined": (["--weight_servers=2"], "applies to execution_mode"),
    }
    dirs = {name: tmp_path / f"run{i}" for i, name in enumerate(cases)}
    argvs = [
        [*argv, f"--runconfig.model_dir={dirs[name]}", "--runconfig.progress_bar=false"]
        for name, (argv, _) in cases.items()
    ]
    (tmp_path / "cases.json").write_text(json.dumps(argvs))
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "tests/mpi/bad_inputs.py",
           str(tmp_path / "cases.json"), str(tmp_path / "results.json")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    for (name, (_, needle)), r in zip(cases.items(), results, strict=True):
        assert r["rc"] == 2, (name, r)
        assert r["stderr"].count("simdist: error: ") == 1, (name, r["stderr"])
        assert r["stderr"].startswith("simdist: error: "), (name, r["stderr"])
        assert needle in r["stderr"], (name, r["stderr"])
        assert not dirs[name].exists(), f"{name}: model_dir was created"
