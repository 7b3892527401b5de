"""Planted bugs the tests must catch, each tried alone on a copy of the repository.

    python tests/mutations.py            # every planted bug; exit 1 if one survives
    python tests/mutations.py NAME ...   # only these

Each `Mutation` names a file, a piece of its source text (which must occur there
exactly once) and what replaces it, and the fast tests that must fail once it is
in. The repository is copied to a temporary directory once; each bug is written
into the copy, the named tests run there (`pytest -x`, the copy first on the
path, so launcher subprocesses import it too), and the file is put back. A bug
counts as caught only if a test fails (pytest's exit code 1): an import or
collection error (2, 3, 4) or no tests run (5) is a broken check, not a catch.
A source text that no longer occurs (the code moved or was rewritten) fails
the check too: update its entry here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("podracer", "tests", "launch", "pyproject.toml")
TEST_FAILED = 1  # pytest's exit code when tests ran and one failed


class Mutation(NamedTuple):
    name: str
    path: str  # relative to the repository root
    original: str  # occurs exactly once in `path`
    replacement: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the root; one must fail


PPO_LOSSES = "podracer/ppo/losses.py"
VTRACE = "podracer/vtrace/vtrace.py"
RESTORE_KEEPS_INITIAL_OPT_STATE = """\
        state = jax.tree_util.tree_map_with_path(
            lambda path, new, old: old if "opt_state" in jax.tree_util.keystr(path) else new, state, like)
        return state, meta

    def wait(self)"""

MUTATIONS = (
    Mutation("ppo lower clip bound removed", PPO_LOSSES,
             "jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)",
             "jnp.minimum(ratio, 1.0 + config.clip_eps)",
             ("tests/test_ppo.py::test_policy_clip_each_side_and_sign",)),
    Mutation("ppo upper clip bound removed", PPO_LOSSES,
             "jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)",
             "jnp.maximum(ratio, 1.0 - config.clip_eps)",
             ("tests/test_ppo.py::test_policy_clip_each_side_and_sign",)),
    Mutation("advantages divided by the variance", PPO_LOSSES,
             "return (advantage - mean) / (std + 1e-8)",
             "return (advantage - mean) / (std**2 + 1e-8)",
             ("tests/test_ppo.py::test_advantage_normalisation_divides_by_the_std",)),
    Mutation("ppo value clip takes the smaller error", PPO_LOSSES,
             "value_error = jnp.maximum(value_error, (value_clipped - samples.target) ** 2)",
             "value_error = jnp.minimum(value_error, (value_clipped - samples.target) ** 2)",
             ("tests/test_ppo.py::test_value_clip_each_side",)),
    Mutation("ppo entropy bonus of the wrong sign", PPO_LOSSES,
             "loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy",
             "loss = policy_loss + config.vf_coef * value_loss + config.ent_coef * entropy",
             ("tests/test_ppo.py::test_loss_hand_computed",)),
    Mutation("gae without lambda", "podracer/ppo/gae.py",
             "continues = gamma * lam * (1.0 - jnp.maximum(",
             "continues = gamma * (1.0 - jnp.maximum(",
             ("tests/test_gae.py",)),
    Mutation("v-trace importance weights inverted", "podracer/vtrace/losses.py",
             "log_rho = jax.lax.stop_gradient(log_prob) - seqs.log_prob",
             "log_rho = seqs.log_prob - jax.lax.stop_gradient(log_prob)",
             ("tests/test_vtrace.py::test_impala_loss_weights_are_learner_over_behaviour",)),
    Mutation("v-trace rho not clipped", VTRACE,
             "rho = jnp.minimum(rho_bar, ratio)", "rho = ratio",
             ("tests/test_vtrace.py::test_hand_computed_clipping_active_and_inactive",)),
    Mutation("v-trace c not clipped", VTRACE,
             "c = lambda_ * jnp.minimum(c_bar, ratio)", "c = lambda_ * ratio",
             ("tests/test_vtrace.py::test_hand_computed_clipping_active_and_inactive",)),
    Mutation("v-trace policy-gradient weight clipped at rho_bar", VTRACE,
             "pg_advantage = jnp.minimum(pg_rho_bar, ratio)", "pg_advantage = jnp.minimum(rho_bar, ratio)",
             ("tests/test_vtrace.py::test_hand_computed_clipping_active_and_inactive",)),
    Mutation("pqn td target of the flipped sign", "podracer/pqn/targets.py",
             "g = r + gamma * cont * blended", "g = r - gamma * cont * blended",
             ("tests/test_pqn.py::test_q_lambda_targets_match_hand_values_across_a_termination_and_a_truncation",)),
    Mutation("dqn without double q-learning", "podracer/dqn/update.py",
             "q_tp1_online = jax.lax.stop_gradient(q_fn(params, batch.next_obs)) if config.double_q else None",
             "q_tp1_online = None",
             ("tests/test_dqn.py::test_the_loss_bootstraps_from_the_online_networks_choice_valued_by_the_target_network",)),
    Mutation("sac actor's entropy term of the wrong sign", "podracer/sac/losses.py",
             "jnp.mean(jax.lax.stop_gradient(alpha) * log_prob - jnp.min(q, axis=0))",
             "jnp.mean(-jax.lax.stop_gradient(alpha) * log_prob - jnp.min(q, axis=0))",
             ("tests/test_sac.py::test_the_actor_loss_pays_alpha_log_prob_and_gains_the_smaller_critic",)),
    Mutation("sac critic target's entropy term of the wrong sign", "podracer/sac/losses.py",
             "soft_value = jnp.min(next_q, axis=0) - alpha * next_log_prob",
             "soft_value = jnp.min(next_q, axis=0) + alpha * next_log_prob",
             ("tests/test_sac.py::test_the_critic_target_takes_the_smaller_target_critic_minus_alpha_log_prob",)),
    Mutation("muzero value target bootstraps one step early", "podracer/muzero/targets.py",
             "gamma ** td_steps * value[k + td_steps]", "gamma ** td_steps * value[k + td_steps - 1]",
             ("tests/test_muzero.py::test_n_step_targets_match_hand_values",)),
    Mutation("sebulba actors keep stale parameters", "podracer/sebulba/params.py",
             "self._copies, self._version = copies, version",
             "self._copies, self._version = self._copies or copies, version",
             ("tests/test_sebulba_params.py",)),
    Mutation("restore without the optimizer state", "podracer/session/checkpoint.py",
             "        return state, meta\n\n    def wait(self)", RESTORE_KEEPS_INITIAL_OPT_STATE,
             ("tests/test_resume_state.py",)),
)


def copy_repository(root: str) -> None:
    for name in COPIED:
        source, target = os.path.join(REPO_ROOT, name), os.path.join(root, name)
        if os.path.isdir(source):
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, target)


def planted(source: str, mutation: Mutation) -> str:
    count = source.count(mutation.original)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: its text occurs {count} times in {mutation.path} "
                         f"(must be once); update tests/mutations.py:\n{mutation.original}")
    return source.replace(mutation.original, mutation.replacement)


def run_tests(root: str, tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-p", "no:cacheprovider",
                           *tests], cwd=root, env=env, capture_output=True, text=True)


def check(mutations) -> list[str]:
    """Each mutation tried on one copy of the repository; the names of those not caught."""
    survived = []
    with tempfile.TemporaryDirectory(prefix="podracer-mutations-") as root:
        copy_repository(root)
        for mutation in mutations:
            path = os.path.join(root, mutation.path)
            with open(path) as f:
                source = f.read()
            with open(path, "w") as f:
                f.write(planted(source, mutation))
            start = time.perf_counter()
            try:
                result = run_tests(root, mutation.tests)
            finally:
                with open(path, "w") as f:
                    f.write(source)
            caught = result.returncode == TEST_FAILED
            verdict = "caught" if caught else f"SURVIVED (pytest exit {result.returncode})"
            print(f"{verdict:>28}  {mutation.name}  ({time.perf_counter() - start:.0f} s)", flush=True)
            if not caught:
                print(result.stdout[-2000:] + result.stderr[-2000:], flush=True)
                survived.append(mutation.name)
    return survived


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    if argv and len(chosen) != len(argv):
        print(f"unknown mutation among {argv}; known: {[m.name for m in MUTATIONS]}", file=sys.stderr)
        return 2
    survived = check(chosen)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} planted bugs caught", flush=True)
    if survived:
        print("survived: " + "; ".join(survived), file=sys.stderr)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
