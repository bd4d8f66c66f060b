"""Tests of the command line `python -m tf_sparse24 prune | export | inspect | verify`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse24
from tf_sparse24 import metadata as md
from tf_sparse24.__main__ import main

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def _mlp(seed: int) -> keras.Sequential:
    """A 16 -> 32 -> 8 MLP, "hidden" and "scores", initialized under `seed`."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((16,), name="features"),
        keras.layers.Dense(32, activation="relu", name="hidden"),
        keras.layers.Dense(8, name="scores"),
    ])  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A pruned (wrapped) model saved as .keras and exported by the CLI in a fresh process."""
    root = tmp_path_factory.mktemp("cli")
    model = tf_sparse24.prune(_mlp(seed=3))
    keras_path = str(root / "model.keras")
    model.save(keras_path)
    export_dir = str(root / "served" / "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tf_sparse24", "export", keras_path, export_dir],
        env=ENV, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    return {"model": model, "keras": keras_path, "dir": export_dir, "proc": proc}


def _cli(cwd, *args: str) -> subprocess.CompletedProcess:
    """`python -m tf_sparse24 *args` in `cwd`, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "tf_sparse24", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=400, check=False)


def _dense_mlp(path) -> keras.Model:
    """A trained-looking 16 -> 32 -> 8 MLP (random weights and biases), saved as `path`."""
    model = _mlp(seed=4)
    rng = np.random.default_rng(4)
    model.set_weights([rng.standard_normal(w.shape).astype("float32") for w in model.weights])
    model.save(path)
    return model


def _magnitude_24(w: np.ndarray) -> np.ndarray:
    """`w [K, N]` keeping the 2 largest |w| of each 4 consecutive rows (numpy reference)."""
    groups = w.reshape(w.shape[0] // 4, 4, -1)
    ranks = np.argsort(np.argsort(-np.abs(groups), axis=1), axis=1)
    return np.where(ranks < 2, groups, 0.0).reshape(w.shape)


def test_prune_command_saves_the_pruned_model_and_prints_its_report(tmp_path, capsys):
    model = _dense_mlp(tmp_path / "dense.keras")
    (w1, b1), (w2, b2) = (layer.get_weights() for layer in model.layers)
    out = str(tmp_path / "pruned.keras")

    assert main(["prune", str(tmp_path / "dense.keras"), out, "--skip", "scores"]) == 0

    stdout = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[2] for line in stdout.splitlines()[2:4]}
    assert rows == {"sparse24_hidden": "pruned", "scores": "not"}  # "not pruned"
    assert f"saved 1 pruned layers to {out}" in stdout
    pruned = keras.saving.load_model(out)
    assert [type(layer).__name__ for layer in pruned.layers] == ["Sparse24", "Dense"]
    x = np.random.default_rng(5).standard_normal((6, 16))
    expected = np.maximum(x @ _magnitude_24(w1.astype(np.float64)) + b1, 0.0) @ w2 + b2
    np.testing.assert_allclose(pruned(x.astype(np.float32)).numpy(), expected,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))  # no partial file left


def test_prune_command_permutes_first_when_asked(tmp_path, capsys):
    model = _dense_mlp(tmp_path / "dense.keras")
    out = str(tmp_path / "pruned.keras")

    assert main(["prune", str(tmp_path / "dense.keras"), out, "--permute"]) == 0

    assert re.search(r"^hidden -> scores \[32 ch\]: kept \|w\| ", capsys.readouterr().out, re.M)
    permuted, _ = tf_sparse24.permute(model, progress=False)
    expected = tf_sparse24.prune(permuted)
    x = np.random.default_rng(6).standard_normal((6, 16)).astype(np.float32)
    np.testing.assert_allclose(keras.saving.load_model(out)(x).numpy(), expected(x).numpy(),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert tf_sparse24.prune(model)(x).numpy() != pytest.approx(expected(x).numpy())


def test_prune_command_errors_leave_the_output_alone(tmp_path, capsys):
    _dense_mlp(tmp_path / "dense.keras")
    dense, out = str(tmp_path / "dense.keras"), tmp_path / "pruned.keras"
    out.write_bytes(b"previous")

    assert main(["prune", dense, str(out)]) == 1
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    assert main(["prune", dense, str(out), "--overwrite", "--skip", "nope"]) == 1
    assert "no layer named ['nope']" in capsys.readouterr().err
    assert main(["prune", dense, str(tmp_path / "pruned.h5")]) == 1
    assert "the output must be a .keras file" in capsys.readouterr().err
    assert out.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["dense.keras", "pruned.keras"]


def test_prune_command_refuses_an_output_it_cannot_write_before_loading_the_model(
        tmp_path, capsys):
    """A dangling link at the output is an existing output (it was replaced without
    --overwrite); a directory, or a missing parent directory, is refused even with --overwrite.
    All before the model is loaded: the model file here does not exist."""
    missing = str(tmp_path / "missing.keras")
    link = tmp_path / "link.keras"
    link.symlink_to(tmp_path / "nowhere.keras")
    assert main(["prune", missing, str(link)]) == 1
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    assert os.path.islink(link) and not os.path.exists(link)
    (tmp_path / "dir.keras").mkdir()
    assert main(["prune", missing, str(tmp_path / "dir.keras"), "--overwrite"]) == 1
    assert "is a directory" in capsys.readouterr().err
    out = str(tmp_path / "no" / "such" / "pruned.keras")
    assert main(["prune", missing, out, "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "directory" in err and "does not exist" in err and "missing.keras" not in err
    assert sorted(os.listdir(tmp_path)) == ["dir.keras", "link.keras"]
    assert os.listdir(tmp_path / "dir.keras") == []


def test_export_command_writes_a_loadable_export(exported):
    proc = exported["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported 2 compressed weights to {exported['dir']}" in proc.stdout
    assert "hidden/kernel" in proc.stdout and "scores/kernel" in proc.stdout
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    served = tf_sparse24.load(exported["dir"]).signatures["serving_default"]
    got = served(features=tf.constant(x))["scores"].numpy()
    np.testing.assert_allclose(got, exported["model"](x).numpy(), rtol=1e-5, atol=1e-5)


def test_inspect_prints_the_table_and_the_json(exported, capsys):
    assert main(["inspect", exported["dir"]]) == 0
    out = capsys.readouterr().out
    assert "mode portable" in out and "input  features: float32 [None, 16]" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("hidden/kernel"))
    # 16x32 float32: values 32*8*4 B + meta 32*2 B = 1088 B of 2048 B dense.
    assert row.split()[-3:] == ["1088", "2048", "0.531"]
    assert main(["inspect", exported["dir"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == md.read(exported["dir"])


def test_verify_against_the_keras_file(exported, capsys):
    assert main(["verify", exported["dir"], "--against", exported["keras"]]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[: out.rindex("}") + 1])
    assert report["tensors"] == 2 * 2 + 2 and report["nonstock_ops"] == []
    assert report["max_abs_diff"]["scores"] < 1e-5


def test_verify_reports_a_corrupted_tensor(exported, tmp_path, capsys):
    target = tmp_path / "1"
    shutil.copytree(exported["dir"], target)
    metadata_path = md.path_in(target)
    with open(metadata_path) as f:
        text = f.read()
    sha = md.read(target)["sparse"][1]["meta"]["sha256"]
    with open(metadata_path, "w") as f:
        f.write(text.replace(sha, "f" * 64))
    assert main(["verify", str(target)]) == 1
    assert "checksum mismatch for assets/sparse24.json" in capsys.readouterr().err


def test_export_refuses_an_existing_directory(exported, capsys):
    assert main(["export", exported["keras"], exported["dir"]]) == 1
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    # --overwrite replaces an export, never the model directory holding it (checked before the
    # model is loaded: a missing model file does not get that far).
    model_dir = os.path.dirname(exported["dir"])
    before = sorted(os.listdir(model_dir))
    assert main(["export", "missing.keras", model_dir, "--overwrite"]) == 1
    assert "overwrite=True replaces only a previous export" in capsys.readouterr().err
    assert sorted(os.listdir(model_dir)) == before


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "only-one-argument"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["verify", "x", "--mode", "fast"])
    assert e.value.code == 2


def test_a_model_that_cannot_be_loaded_is_an_error_line_not_a_traceback(tmp_path, capsys):
    """load_model raises TypeError for a custom class it cannot locate (its module not imported)."""

    @keras.saving.register_keras_serializable(package="test_cli_gone")
    class Gone(keras.layers.Dense):
        pass

    model = keras.Sequential([keras.Input((4,)), Gone(4, name="d")])
    path = str(tmp_path / "model.keras")
    model.save(path)
    keras.saving.get_custom_objects().pop("test_cli_gone>Gone")  # as in a process without it
    assert main(["export", path, str(tmp_path / "out" / "1")]) == 1
    err = capsys.readouterr().err
    assert "tf_sparse24 export: error: TypeError: " in err and "test_cli_gone>Gone" in err
    assert not (tmp_path / "out").exists()


@keras.saving.register_keras_serializable(package="test_cli")
class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = tf_sparse24.Sparse24(keras.layers.Dense(16, activation="relu"))
        self.head = tf_sparse24.Sparse24(keras.layers.Dense(4))

    def call(self, x):
        return self.head(self.hidden(x))


def test_export_of_a_subclassed_model_takes_its_inputs_from_the_command_line(tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    net = Net()
    net(x)
    model = tf_sparse24.prune(net)
    path = str(tmp_path / "net.keras")
    model.save(path)
    assert main(["export", path, str(tmp_path / "a" / "1")]) == 1
    assert "--input NAME:DTYPE:SHAPE" in capsys.readouterr().err
    assert main(["export", path, str(tmp_path / "b" / "1"), "--input", "x:float32:None,8"]) == 0
    served = tf_sparse24.load(tmp_path / "b" / "1").signatures["serving_default"]
    np.testing.assert_allclose(
        served(x=tf.constant(x))["output_0"].numpy(), model(x), rtol=1e-5, atol=1e-6
    )
    for spec, message in [
        ("x:float32", "expected NAME:DTYPE:SHAPE"),
        ("x:float32:None,8:extra", "expected NAME:DTYPE:SHAPE"),
        ("x:float32:-3,8", "sizes >= 0"),
        ("a b:float32:None,8", "input name 'a b' .* start with a letter"),
        ("_x:float32:None,8", "input name '_x' .* start with a letter"),
        ("in:float32:None,8", "input name 'in' .* not Python keywords"),
    ]:
        with pytest.raises(SystemExit) as bad:
            main(["export", path, str(tmp_path / "c" / "1"), "--input", spec])
        assert bad.value.code == 2
        assert re.search(message, capsys.readouterr().err), spec
    assert not (tmp_path / "c").exists()


def test_time_distributed_with_unknown_steps_is_refused_and_exports_with_input(tmp_path, capsys):
    """A `.keras` sequence model with TimeDistributed over `Input((None, 16))`: refused with the
    layer named and the command-line way out; `--input` with a fixed step count exports it."""
    keras.utils.set_random_seed(0)
    frames = keras.Input((None, 16), name="frames")
    td = keras.layers.TimeDistributed(keras.layers.Dense(8, name="d"), name="td")
    model = tf_sparse24.prune(keras.Model(frames, td(frames)))
    path = str(tmp_path / "td.keras")
    model.save(path)
    assert main(["export", path, str(tmp_path / "a" / "1")]) == 1
    err = capsys.readouterr().err
    assert "layer 'td' (TimeDistributed) is served with an unknown number of time steps" in err
    assert "(here: --input NAME:DTYPE:SHAPE)" in err
    assert not (tmp_path / "a").exists()
    out = str(tmp_path / "b" / "1")
    assert main(["export", path, out, "--input", "frames:float32:None,5,16"]) == 0
    x = np.random.default_rng(2).standard_normal((3, 5, 16)).astype(np.float32)
    dense = model.get_layer("sparse24_td").layer.layer
    groups = dense.kernel.numpy().astype(np.float64).reshape(4, 4, 8)  # 2:4 by magnitude:
    smallest = np.argsort(np.abs(groups), axis=1, kind="stable")[:, :2]  # the 2 of 4 dropped
    np.put_along_axis(groups, smallest, 0.0, axis=1)
    kernel = groups.reshape(16, 8)
    served = tf_sparse24.load(out).signatures["serving_default"](frames=x)["td"].numpy()
    np.testing.assert_allclose(served, x @ kernel + dense.bias.numpy(), rtol=1e-5, atol=1e-5)


def test_a_lambda_layer_model_exports_once_unsafe_loading_is_imported(tmp_path, capsys):
    """Keras refuses to load a Lambda layer's Python code unless told it is trusted; the CLI says
    how (an --import module that enables it), and that export then serves the model."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), name="x")
    scaled = keras.layers.Lambda(lambda t: t * 2.0, name="double")(inp)
    model = tf_sparse24.prune(keras.Model(inp, keras.layers.Dense(4, name="out")(scaled)))
    path = str(tmp_path / "lambda.keras")
    model.save(path)
    assert main(["export", path, str(tmp_path / "a" / "1")]) == 1
    err = capsys.readouterr().err
    assert "safe_mode" in err and "(here: --import a module that calls keras.config." in err
    assert not (tmp_path / "a").exists()
    # In a fresh process: unsafe loading, once enabled, stays on for the rest of it.
    (tmp_path / "trust_my_file.py").write_text(
        "import keras\nkeras.config.enable_unsafe_deserialization()\n")
    out = str(tmp_path / "b" / "1")
    proc = _cli(tmp_path, "export", path, out, "--import", "trust_my_file")
    assert proc.returncode == 0, proc.stderr[-3000:]
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    dense = model.get_layer("sparse24_out").layer
    groups = dense.kernel.numpy().astype(np.float64).reshape(2, 4, 4)  # 2:4 by magnitude
    np.put_along_axis(groups, np.argsort(np.abs(groups), axis=1, kind="stable")[:, :2], 0.0, 1)
    served = tf_sparse24.load(out).signatures["serving_default"](x=x)["out"].numpy()
    np.testing.assert_allclose(served, 2.0 * x @ groups.reshape(8, 4) + dense.bias.numpy(),
                               rtol=1e-5, atol=1e-5)


NET_MODULE = '''
import keras
import tf_sparse24


@keras.saving.register_keras_serializable(package="cli_net")
class CliNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = tf_sparse24.Sparse24(keras.layers.Dense(4))

    def call(self, x):
        return self.head(x)
'''


def test_import_registers_a_subclassed_models_class_in_a_fresh_process(tmp_path, monkeypatch):
    (tmp_path / "cli_net_module.py").write_text(NET_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from cli_net_module import CliNet  # noqa: PLC0415  (written just above)

    net = CliNet()
    net(np.ones((2, 8), np.float32))
    tf_sparse24.prune(net).save(str(tmp_path / "net.keras"))
    command = ["export", "net.keras", "out/1", "--input", "x:float32:None,8"]
    without = _cli(tmp_path, *command)
    assert without.returncode == 1 and "Could not locate class 'CliNet'" in without.stderr
    done = _cli(tmp_path, *command, "--import", "cli_net_module")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exported 1 compressed weights" in done.stdout


BLOCK_MODULE = '''
import keras


@keras.saving.register_keras_serializable(package="cli_block")
class CliBlock(keras.layers.Layer):
    """keras.io's TransformerBlock pattern: a sublayer made in __init__ without a dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8)

    def call(self, x):
        return x + self.inner(x)
'''


def test_import_can_set_the_policy_a_block_layer_was_saved_under(tmp_path, monkeypatch):
    """docs/EXPORT.md: such a block saved under mixed_bfloat16 loads (Keras) only under that global
    policy; an --import module that sets it lets the CLI export it, serving the model's outputs."""
    (tmp_path / "cli_block_module.py").write_text(BLOCK_MODULE)
    (tmp_path / "bf16_policy.py").write_text(
        'import keras\nkeras.mixed_precision.set_global_policy("mixed_bfloat16")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    from cli_block_module import CliBlock  # noqa: PLC0415  (written just above)

    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,), name="features")
        outputs = keras.layers.Dense(4, dtype="float32", name="scores")(CliBlock()(inputs))
        model = tf_sparse24.prune(keras.Model(inputs, outputs))
        model.save(str(tmp_path / "block.keras"))
        expected = np.asarray(model(x), np.float64)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    command = ["export", "block.keras", "out/1", "--import", "cli_block_module"]
    without = _cli(tmp_path, *command)
    assert without.returncode == 1 and "does not match type bfloat16" in without.stderr
    done = _cli(tmp_path, *command, "--import", "bf16_policy")
    assert done.returncode == 0, done.stderr[-2000:]
    served = tf.saved_model.load(str(tmp_path / "out" / "1")).signatures["serving_default"]
    got = served(features=tf.constant(x))["scores"].numpy().astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-2 * max(1.0, np.abs(expected).max()))


@keras.saving.register_keras_serializable(package="test_cli")
class DictNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = tf_sparse24.Sparse24(keras.layers.Dense(4))

    def call(self, inputs):
        return self.head(inputs["x"]) * 2.0


def test_dict_inputs_export_a_subclassed_model_called_with_a_dict(tmp_path, capsys):
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    net = DictNet()
    net({"x": x})
    model = tf_sparse24.prune(net)
    path = str(tmp_path / "net.keras")
    model.save(path)
    assert main(["export", path, str(tmp_path / "a" / "1"), "--input", "x:float32:None,8"]) == 1
    err = capsys.readouterr().err
    assert "needs --dict-inputs" in err and err.count("\n") == 1  # one line
    assert not (tmp_path / "a").exists()
    argv = ["export", path, str(tmp_path / "b" / "1"), "--input", "x:float32:None,8"]
    assert main([*argv, "--dict-inputs"]) == 0
    served = tf_sparse24.load(tmp_path / "b" / "1").signatures["serving_default"]
    kernel = model.head.layer.kernel.numpy() * model.head.pruned_weights[0].mask.numpy()
    np.testing.assert_allclose(served(x=x)["output_0"].numpy(), 2.0 * (x @ kernel),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    with pytest.raises(SystemExit) as bad:
        main(["export", path, str(tmp_path / "c" / "1"), "--dict-inputs"])
    assert bad.value.code == 2 and "--dict-inputs needs" in capsys.readouterr().err
    assert main(argv) == 1  # exists: no hint about dicts there
    assert "--dict-inputs" not in capsys.readouterr().err
