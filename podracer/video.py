"""`eval --video=PATH`: evaluation episodes as an MP4 or GIF, the running return drawn on each frame.

Frames come from the environment itself where it can draw: gymnax's classic
control through Gymnasium's renderer of the same system, the JAX suites that
draw themselves (Navix, Craftax, brax's renderer), envpool's Atari frames.
Anything else is refused in one line before an episode is played. Each
episode contributes one frame per state it visits: its first observation and
one after every step (length + 1 frames).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import jax
import numpy as np

from podracer.errors import PodracerError

# gymnax classic control -> (the Gymnasium id that draws the same system, its state from gymnax's)
_GYMNASIUM_TWINS: dict[str, tuple[str, Callable]] = {
    "CartPole-v1": ("CartPole-v1", lambda s: [s.x, s.x_dot, s.theta, s.theta_dot]),
    "Pendulum-v1": ("Pendulum-v1", lambda s: [s.theta, s.theta_dot]),
    "MountainCar-v0": ("MountainCar-v0", lambda s: [s.position, s.velocity]),
    "MountainCarContinuous-v0": ("MountainCarContinuous-v0", lambda s: [s.position, s.velocity]),
    "Acrobot-v1": ("Acrobot-v1", lambda s: [s.joint_angle1, s.joint_angle2, s.velocity_1, s.velocity_2]),
}
SUFFIXES = (".mp4", ".gif")


def check_path(path: str) -> None:
    if not path.lower().endswith(SUFFIXES):
        raise PodracerError(f"--video={path}: name an .mp4 or a .gif file")
    try:
        import imageio  # noqa: F401
    except ImportError:
        raise PodracerError("--video needs imageio: pip install -e \".[video]\"") from None
    from podracer.storage import probe_creatable

    probe_creatable(path, "--video")  # before the policy is loaded and its episodes played


def anakin_renderer(env_id: str, env) -> Callable:
    """`frame(inner_state) -> [H, W, 3] uint8` for an Anakin environment, or a one-line refusal."""
    render_fn = getattr(env, "render_fn", None)
    if render_fn is not None:
        return render_fn
    if env_id in _GYMNASIUM_TWINS:
        _check_pygame(env_id)
        import gymnasium

        name, state_of = _GYMNASIUM_TWINS[env_id]
        twin = gymnasium.make(name, render_mode="rgb_array").unwrapped
        twin.reset(seed=0)

        def frame(inner):
            twin.state = np.asarray([float(v) for v in state_of(inner)], np.float64)
            return twin.render()

        return frame
    raise PodracerError(f"{env_id} cannot render: --video draws gymnax classic control "
                        f"({', '.join(_GYMNASIUM_TWINS)}), navix, craftax and brax environments, and envpool Atari")


def _check_pygame(env_id: str) -> None:
    """Gymnasium draws classic control with pygame (the `video` extra installs it).

    Its renderer calls `pygame.init()`, which also opens the sound card and the
    display: on a machine without them SDL fills the console with ALSA and
    XDG_RUNTIME_DIR errors. Frames are drawn off-screen, so unless the user
    chose drivers, SDL gets its dummy ones.
    """
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    try:
        import pygame  # noqa: F401
    except ImportError:
        raise PodracerError(f"--video draws {env_id} with pygame, which is not installed: "
                            f"pip install -e \".[video]\"") from None


def label(frame: np.ndarray, text: str) -> np.ndarray:
    """`frame` (upscaled to at least 160 pixels high) with `text` in its top-left corner."""
    from PIL import Image, ImageDraw

    frame = np.asarray(frame)
    if frame.dtype != np.uint8:
        frame = np.clip(frame, 0, 255).astype(np.uint8)
    if frame.ndim == 2:
        frame = np.repeat(frame[..., None], 3, -1)
    scale = max(1, -(-160 // frame.shape[0]))
    frame = np.repeat(np.repeat(frame, scale, 0), scale, 1)
    frame = frame[: frame.shape[0] // 2 * 2, : frame.shape[1] // 2 * 2]  # even sides for H.264
    image = Image.fromarray(np.ascontiguousarray(frame[..., :3]))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 8 + 7 * len(text), 14), fill=(0, 0, 0))
    draw.text((3, 2), text, fill=(255, 255, 255))
    return np.asarray(image)


def write(path: str, frames: list[np.ndarray], fps: int = 30) -> None:
    import imageio.v2 as imageio

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.lower().endswith(".gif"):
        imageio.mimsave(path, frames, duration=1000 / fps, loop=0)
    else:
        with warnings.catch_warnings():
            # imageio starts ffmpeg with fork and exec: the child runs no Python and no JAX,
            # so the deadlock JAX's fork warning is about cannot happen.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            imageio.mimsave(path, frames, fps=fps, macro_block_size=1)


def anakin_video(act: Callable, env_id: str, episodes: int, seed: int, path: str) -> dict:
    """Play `episodes` episodes one after another, drawing each state; returns their lengths,
    returns and the number of frames written."""
    from podracer.envs.jax_envs import make_env

    check_path(path)
    env = make_env(env_id)
    frame_of = anakin_renderer(env_id, env)
    reset, step = jax.jit(env.reset), jax.jit(env.step)
    act = jax.jit(act)
    stepped_inner = jax.jit(env.stepped_inner)
    key = jax.random.PRNGKey(seed)
    frames, lengths, returns = [], [], []
    for episode in range(episodes):
        key, reset_key = jax.random.split(key)
        state, ts = reset(reset_key)
        obs, total = ts.obs, 0.0
        frames.append(label(frame_of(state.inner), f"episode {episode + 1} return {total:.1f}"))
        for t in range(env.horizon):
            key, act_key, env_key = jax.random.split(key, 3)
            action = act(obs[None], act_key)[0]
            before = state
            state, ts = step(env_key, state, action)
            total += float(ts.reward)
            done = bool(ts.terminated | ts.truncated)
            # The state that ended an episode is gone after the auto-reset: draw it from a step
            # without one (the same transition: the reset is only selected where the episode ended).
            shown = stepped_inner(env_key, before, action) if done else state.inner
            frames.append(label(frame_of(shown), f"episode {episode + 1} return {total:.1f}"))
            obs = ts.obs
            if done:
                break
        lengths.append(t + 1)
        returns.append(total)
    write(path, frames)
    return {"video": path, "frames": len(frames), "episode_lengths": lengths, "episode_returns": returns}


def envpool_video(act: Callable, env_id: str, episodes: int, seed: int, path: str) -> dict:
    """Atari games played one after another, one frame per envpool result (the newest stacked
    frame), life losses included; returns the games' lengths in agent steps."""
    from podracer.sebulba.envs import EnvPoolEnvs, is_atari

    check_path(path)
    if not is_atari(env_id):
        raise PodracerError(f"{env_id} cannot render: --video draws envpool's Atari frames only "
                            f"(on Sebulba); MuJoCo and classic control ids have no frames")
    envs = EnvPoolEnvs(env_id, 1, 1, 0, seed=seed)
    act, key = jax.jit(act), jax.random.PRNGKey(seed)
    frames, lengths, scores = [], [], []
    try:
        envs.start()
        while len(lengths) < episodes:
            step = envs.recv()
            score = float(step.episode_return[0])
            frames.append(label(step.obs[0][-1], f"game {len(lengths) + 1} score {score:.0f}"))
            if step.episode_done[0]:
                lengths.append(int(step.episode_length[0]))
                scores.append(score)
            key, act_key = jax.random.split(key)
            envs.send(np.asarray(act(step.obs, act_key)), step.env_ids)
    finally:
        envs.close()
    write(path, frames)
    return {"video": path, "frames": len(frames), "episode_lengths": lengths, "episode_returns": scores}
