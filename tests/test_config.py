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
        (["--zero_opt_level", "3"], "zero_opt_level must be 0, 1 or 2"),
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
