"""RLDS datasets on disk: what podracer writes, what it reads (its own and other tools'
datasets), and the one-line errors for datasets it cannot use."""

import json
import os
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core.sequential_writer import SequentialWriter

from conftest import REPO_ROOT
from podracer import data
from podracer.envs.jax_envs import make_env
from podracer.data.train_hooks import load_demonstrations
from podracer.errors import PodracerError

SPEC = data.step_spec((3,), np.float32, (), np.int64)


def _episode(rng, transitions, terminated):
    """An RLDS-layout episode of `transitions` transitions plus the final-observation step."""
    length = transitions + 1
    steps = {
        "observation": rng.normal(size=(length, 3)).astype(np.float32),
        "action": np.append(rng.integers(0, 2, transitions), 0),
        "reward": np.append(rng.normal(size=transitions), 0.0).astype(np.float32),
        "discount": np.append(np.ones(transitions), 0.0).astype(np.float32),
        "is_terminal": np.arange(length) == transitions if terminated else np.zeros(length, bool),
        "policy_log_prob": np.append(-rng.random(transitions), 0.0).astype(np.float32),
    }
    if terminated:
        steps["discount"][transitions - 1] = 0.0
    return steps


def _assert_one_line_error(call, *fragments):
    with pytest.raises(PodracerError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_written_episodes_read_back_exactly_with_metadata(tmp_path):
    rng = np.random.default_rng(0)
    episodes = [_episode(rng, n, terminated=n % 2 == 0) for n in (5, 1, 8)]
    with data.DatasetWriter(str(tmp_path / "ds"), SPEC, metadata={"env": "Toy-v0", "seed": 7}) as writer:
        assert [writer.add_episode(steps) for steps in episodes] == [0, 1, 2]
    read = data.read_episodes(str(tmp_path / "ds"))
    assert len(read) == 3
    for episode_id, (written, got) in enumerate(zip(episodes, read)):
        assert int(got["episode_id"]) == episode_id
        assert int(got["episode_length"]) == len(written["observation"]) - 1
        assert float(got["episode_return"]) == pytest.approx(float(written["reward"].sum()))
        for field, value in written.items():
            np.testing.assert_array_equal(got["steps"][field], value, err_msg=field)
            assert got["steps"][field].dtype == SPEC[field].dtype
        position = np.arange(len(written["observation"]))
        np.testing.assert_array_equal(got["steps"]["is_first"], position == 0)
        np.testing.assert_array_equal(got["steps"]["is_last"], position == position[-1])
    assert data.dataset_metadata(str(tmp_path / "ds")) == {"env": "Toy-v0", "seed": 7}
    # tfds itself (no TensorFlow) sees the same dataset: array_record, three episodes.
    builder = tfds.builder_from_directory(str(tmp_path / "ds"))
    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    source = builder.as_data_source(split="train")
    assert len(source) == 3
    first_steps = list(source[0]["steps"])
    np.testing.assert_array_equal(np.stack([s["observation"] for s in first_steps]),
                                  episodes[0]["observation"])

    batch = data.load_episodes(str(tmp_path / "ds"))
    assert batch.mask.shape == (3, 9) and batch.mask.sum(axis=1).tolist() == [6, 2, 9]
    assert batch.steps["observation"].shape == (3, 9, 3)
    assert not batch.steps["observation"][1, 2:].any()  # zero padding


def test_serialization_matches_tfds_own_encoding(tmp_path):
    # The writer skips tfds's per-step Python encoding; the bytes must be what it would produce.
    rng = np.random.default_rng(1)
    steps = _episode(rng, 4, terminated=True)
    steps["is_first"] = np.arange(5) == 0
    steps["is_last"] = np.arange(5) == 4
    features = data.spec.tfds_features(SPEC)
    example = {"steps": steps, "episode_id": 0, "episode_return": np.float32(steps["reward"][:-1].sum()),
               "episode_length": 4}
    with data.DatasetWriter(str(tmp_path / "ds"), SPEC) as writer:
        writer.add_episode(steps)
    raw = tfds.builder_from_directory(str(tmp_path / "ds")).as_data_source(
        split="train", deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
    assert raw[0] == features.serialize_example(example)


def test_step_by_step_from_threads_equals_whole_episodes(tmp_path):
    rng = np.random.default_rng(2)
    episodes = {(actor, n): _episode(rng, 3 + n + actor, terminated=n == 1)
                for actor in range(4) for n in range(3)}
    with data.DatasetWriter(str(tmp_path / "ds"), SPEC) as writer:
        def actor(actor_id):
            for n in range(3):
                steps = episodes[(actor_id, n)]
                for t in range(len(steps["observation"]) - 1):
                    writer.add_step(steps["observation"][t], steps["action"][t], steps["reward"][t],
                                    policy_log_prob=steps["policy_log_prob"][t], stream=actor_id)
                writer.end_episode(steps["observation"][-1], terminated=bool(steps["is_terminal"][-1]),
                                   stream=actor_id)

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        # An episode left open when the writer closes is dropped.
        writer.add_step(np.zeros(3), 0, 1.0, stream="unfinished")
    read = data.read_episodes(str(tmp_path / "ds"))
    assert len(read) == 12
    assert sorted(int(e["episode_id"]) for e in read) == list(range(12))
    written = {episodes[key]["observation"].tobytes(): episodes[key] for key in episodes}
    for got in read:
        expected = written.pop(got["steps"]["observation"].tobytes())
        for field, value in expected.items():
            np.testing.assert_array_equal(got["steps"][field], value, err_msg=field)
    assert not written


def _write_with_tfds(path, step_features, episodes, metadata_features=None, file_format="array_record"):
    """Write an RLDS-shaped dataset with tfds's own writer, as other tools do."""
    features = tfds.features.FeaturesDict({"steps": tfds.features.Dataset(step_features),
                                           **(metadata_features or {})})
    os.makedirs(path)
    info = tfds.core.DatasetInfo(
        builder=tfds.core.DatasetIdentity(name="other_tool", version="1.2.0", data_dir=str(path),
                                          module_name=""), features=features)
    writer = SequentialWriter(info, max_examples_per_shard=2, file_format=file_format)
    writer.initialize_splits(["train"])
    writer.add_examples({"train": episodes})
    writer.close_all()


def test_reads_other_tools_datasets_nested_and_encoded_fields(tmp_path):
    # A nested observation and a zlib-encoded field (decoded step by step through tfds),
    # three shards, a root data_dir with NAME/VERSION below it.
    step_features = {
        "observation": {"position": tfds.features.Tensor(shape=(2,), dtype=np.float32),
                        "velocity": tfds.features.Tensor(shape=(2,), dtype=np.float32,
                                                         encoding=tfds.features.Encoding.ZLIB)},
        "action": tfds.features.Tensor(shape=(2,), dtype=np.float32),
        "reward": tfds.features.Scalar(dtype=np.float32),
        "is_first": tfds.features.Scalar(dtype=np.bool_),
        "is_last": tfds.features.Scalar(dtype=np.bool_),
    }
    rng = np.random.default_rng(3)
    episodes = []
    for length in (4, 7, 2, 5, 3):
        episodes.append({"steps": {
            "observation": {"position": rng.normal(size=(length, 2)).astype(np.float32),
                            "velocity": rng.normal(size=(length, 2)).astype(np.float32)},
            "action": rng.normal(size=(length, 2)).astype(np.float32),
            "reward": rng.normal(size=length).astype(np.float32),
            "is_first": np.arange(length) == 0, "is_last": np.arange(length) == length - 1},
            "episode_id": len(episodes)})
    _write_with_tfds(tmp_path / "other_tool" / "1.2.0", step_features, episodes,
                     {"episode_id": tfds.features.Scalar(dtype=np.int64)})
    read = data.read_episodes(str(tmp_path))
    assert [int(e["episode_id"]) for e in read] == list(range(5))
    for written, got in zip(episodes, read):
        for key in ("position", "velocity"):
            np.testing.assert_array_equal(got["steps"]["observation"][key],
                                          written["steps"]["observation"][key])
        np.testing.assert_array_equal(got["steps"]["action"], written["steps"]["action"])
    windows = data.load_windows(str(tmp_path), size=3, stride=2)
    # Windows per episode: lengths 4, 7, 2, 5, 3 -> starts {0}, {0, 2, 4}, {}, {0, 2}, {0}.
    assert windows["action"].shape == (7, 3, 2)
    assert windows["observation"]["velocity"].shape == (7, 3, 2)
    np.testing.assert_array_equal(windows["action"][2], episodes[1]["steps"]["action"][2:5])
    np.testing.assert_array_equal(windows["reward"][6], episodes[4]["steps"]["reward"])
    _assert_one_line_error(
        lambda: data.load_episodes(str(tmp_path), requirements={"observation/speed": None}),
        "steps/observation/speed")


def test_reads_tfrecord_datasets_without_tensorflow(tmp_path):
    # The same episodes stored as tfrecord, the format most published RLDS datasets use.
    rng = np.random.default_rng(4)
    episodes = [_episode(rng, n, terminated=True) for n in (3, 6)]
    source = tmp_path / "array_record"
    with data.DatasetWriter(str(source), SPEC) as writer:
        for steps in episodes:
            writer.add_episode(steps)
    raw = tfds.builder_from_directory(str(source)).as_data_source(
        split="train", deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
    target = tmp_path / "tfrecord"
    target.mkdir()
    for name in ("features.json", "dataset_info.json"):
        text = (source / name).read_text()
        if name == "dataset_info.json":
            info = json.loads(text)
            info["fileFormat"] = "tfrecord"
            text = json.dumps(info)
        (target / name).write_text(text)
    with open(target / "podracer_episodes-train.tfrecord-00000", "wb") as file:
        for record in raw:
            # TFRecord framing; the CRCs are not checked by the reader.
            file.write(struct.pack("<Q", len(record)) + b"\0" * 4 + record + b"\0" * 4)
    read = data.read_episodes(str(target))
    assert len(read) == 2
    for written, got in zip(episodes, read):
        np.testing.assert_array_equal(got["steps"]["observation"], written["observation"])


def test_unusable_datasets_get_one_line_errors(tmp_path):
    cartpole = make_env("CartPole-v1")
    _assert_one_line_error(lambda: data.load_episodes(str(tmp_path / "missing")), "does not exist")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(lambda: data.load_episodes(str(tmp_path / "empty")),
                           "no tensorflow-datasets dataset")

    def demos(data_dir):
        return load_demonstrations(data_dir, cartpole.spec, cartpole.env_id, 0.99)

    # Mis-shaped: three-number observations where CartPole has four.
    with data.DatasetWriter(str(tmp_path / "three"), SPEC) as writer:
        writer.add_episode(_episode(np.random.default_rng(5), 4, terminated=True))
    _assert_one_line_error(lambda: demos(str(tmp_path / "three")),
                           "steps/observation", "(3,)", "(4,)", "CartPole-v1")

    # Missing: an RLDS dataset with no actions.
    _write_with_tfds(tmp_path / "no_action", {
        "observation": tfds.features.Tensor(shape=(4,), dtype=np.float32),
        "is_first": tfds.features.Scalar(dtype=np.bool_), "is_last": tfds.features.Scalar(dtype=np.bool_)},
        [{"steps": {"observation": np.zeros((2, 4), np.float32), "is_first": [True, False],
                    "is_last": [False, True]}}])
    _assert_one_line_error(lambda: demos(str(tmp_path / "no_action")),
                           "no steps/action field", "behaviour cloning")

    # Not RLDS-shaped at all: no sequence of steps.
    os.makedirs(tmp_path / "flat")
    info = tfds.core.DatasetInfo(
        builder=tfds.core.DatasetIdentity(name="flat", version="1.0.0", data_dir=str(tmp_path / "flat"),
                                          module_name=""),
        features=tfds.features.FeaturesDict({"x": tfds.features.Scalar(dtype=np.float32)}))
    flat = SequentialWriter(info, max_examples_per_shard=10, file_format="array_record")
    flat.initialize_splits(["train"])
    flat.add_examples({"train": [{"x": 1.0}]})
    flat.close_all()
    _assert_one_line_error(lambda: data.load_episodes(str(tmp_path / "flat")), "not RLDS-shaped")

    # Discrete actions out of CartPole's range, and float actions for a discrete env.
    spec4 = data.step_spec((4,), np.float32, (), np.int64)
    steps = _episode(np.random.default_rng(6), 3, terminated=True)
    steps["observation"] = np.zeros((4, 4), np.float32)
    steps["action"] = np.array([0, 5, 1, 0])
    with data.DatasetWriter(str(tmp_path / "range"), spec4) as writer:
        writer.add_episode(steps)
    _assert_one_line_error(lambda: demos(str(tmp_path / "range")), "0..1")
    with data.DatasetWriter(str(tmp_path / "float"), data.step_spec((4,), np.float32, (), np.float32)) as w:
        w.add_episode({**steps, "action": np.zeros(4, np.float32)})
    _assert_one_line_error(lambda: demos(str(tmp_path / "float")), "integer")

    # Records that do not match features.json (files from another spec).
    (tmp_path / "three" / "features.json").write_text((tmp_path / "range" / "features.json").read_text())
    _assert_one_line_error(lambda: data.load_episodes(str(tmp_path / "three")),
                           "episode 0 does not match")

    # Several datasets below one directory, an unknown split, a directory that is in use.
    _assert_one_line_error(lambda: data.load_episodes(str(tmp_path)), "datasets", "pass the directory")
    _assert_one_line_error(lambda: data.load_episodes(str(tmp_path / "range"), "test"), "no split 'test'")
    _assert_one_line_error(lambda: data.DatasetWriter(str(tmp_path / "range"), SPEC), "not empty")


def test_windows_and_returns_to_go_hand_computed():
    batch = data.pad_episodes([
        {"steps": {"x": np.arange(4), "is_last": np.arange(4) == 3}, "id": 0},
        {"steps": {"x": np.arange(10, 12), "is_last": np.arange(2) == 1}, "id": 1},
    ])
    assert batch.mask.tolist() == [[True] * 4, [True, True, False, False]]
    np.testing.assert_array_equal(data.windows(batch, 2)["x"], [[0, 1], [1, 2], [2, 3], [10, 11]])
    np.testing.assert_array_equal(data.windows(batch, 3, stride=2)["x"], [[0, 1, 2]])
    unpadded = data.unpad_episodes(batch)
    np.testing.assert_array_equal(unpadded[1]["steps"]["x"], [10, 11])

    reward = np.array([[1.0, 2.0, 4.0, 0.0]])
    discount = np.array([[1.0, 0.0, 1.0, 0.0]])  # the transition at t=1 terminated
    mask = np.array([[True, True, True, False]])
    np.testing.assert_allclose(data.returns_to_go(reward, discount, mask, 0.5),
                               [[1.0 + 0.5 * 2.0, 2.0, 4.0, 0.0]])


def test_without_the_data_extra_training_works_and_datasets_say_how_to_install(tmp_path):
    # tensorflow-datasets made unimportable: the CLI still imports, a dataset flag is one line.
    code = (
        "import sys; sys.modules['tensorflow_datasets'] = None\n"
        "from podracer.orchestrate.cli import main\n"
        "import podracer.anakin.train, podracer.data\n"
        f"sys.exit(main(['--record-dataset={tmp_path / 'ds'}', '--run-dir={tmp_path / 'run'}']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and 'pip install "podracer-rl[data]"' in result.stderr
    assert not (tmp_path / "ds").exists()
