"""OGBench evaluation envs, stepped in batches: in this process (EvalEnvs) or by a few worker processes
(EvalWorkers), each of which owns a slice of the envs and steps all of them per message.

gymnasium's AsyncVectorEnv gives every env a process and a message each way per step; with 50 envs on 2 cores it
stepped 1.58x slower than one process (docs/benchmarks.md). Here a step of the batch is one round trip per worker.

The interface is what `flexloop_gciql.rollout` uses (no auto-reset). Only the envs named by a mask are reset or
stepped: an env with no episode left to run stands still instead of stepping physics nobody reads.

    envs = EvalWorkers("pointmaze-large-stitch-v0", num_envs=50, workers=4)      # or EvalEnvs(name, num_envs=50)
    obs, info = envs.reset(seed=[...], options={"reset_mask": mask, "task_ids": tasks})   # info["goal"]
    obs, reward, terminated, truncated, info = envs.step(actions, running)               # info["success"]
    envs.close()

Rows that are not reset or stepped come back as zeros. Env i is reset with ogbench_data.reset_episode, so an
episode is the same in any process and whichever env runs it.
"""

import multiprocessing
import signal
import sys
import traceback

import numpy as np


class EvalEnvs:
    """num_envs evaluation envs of env_name in this process."""

    def __init__(self, env_name, num_envs):
        from envs import ogbench_data

        if num_envs < 1:
            raise ValueError(f"the evaluation envs need num_envs >= 1, got {num_envs}")
        self.reset_episode = ogbench_data.reset_episode
        self.num_envs, self.envs = num_envs, []
        try:
            for _ in range(num_envs):
                self.envs.append(ogbench_data.make_eval_env(env_name))
        except BaseException:  # close the envs made before the failure
            self.close()
            raise
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.obs_dim = self.single_observation_space.shape[0]

    def reset(self, *, seed, options):
        obs = np.zeros((self.num_envs, self.obs_dim), np.float32)
        goals = np.zeros_like(obs)
        for i in np.flatnonzero(options["reset_mask"]):
            obs[i], info = self.reset_episode(self.envs[i], int(seed[i]), int(options["task_ids"][i]))
            goals[i] = info["goal"]
        return obs, {"goal": goals}

    def step(self, actions, running=None):
        count = self.num_envs
        obs = np.zeros((count, self.obs_dim), np.float32)
        reward, success = np.zeros(count), np.zeros(count)
        terminated, truncated = np.zeros(count, bool), np.zeros(count, bool)
        for i in range(count) if running is None else np.flatnonzero(running):
            obs[i], reward[i], terminated[i], truncated[i], info = self.envs[i].step(actions[i])
            success[i] = info["success"]
        return obs, reward, terminated, truncated, {"success": success}

    def close(self):
        for env in self.envs:
            env.close()
        self.envs = []


def _serve(connection, env_name, count):
    """A worker: `count` evaluation envs (EvalEnvs), reset and stepped on command. Every reply is (error, result):
    a failure goes back as its traceback, for the parent to raise."""
    # a forked worker starts with the parent's signal handlers: a training run's would keep it alive through
    # SIGTERM and so keep the parent waiting for it at exit. The parent stops its workers: Ctrl-C is for the parent
    # alone, and SIGTERM ends a worker at once (it holds nothing worth saving)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    envs = None
    try:
        envs = EvalEnvs(env_name, count)
        connection.send((None, (envs.single_observation_space, envs.single_action_space)))
        while True:
            command, payload = connection.recv()
            if command == "reset":
                seeds, mask, task_ids = payload
                obs, info = envs.reset(seed=seeds, options={"reset_mask": mask, "task_ids": task_ids})
                connection.send((None, (obs, info["goal"])))
            elif command == "step":
                obs, reward, terminated, truncated, info = envs.step(*payload)
                connection.send((None, (obs, reward, terminated, truncated, info["success"])))
            else:  # "close"
                break
    except EOFError:  # the parent is gone: nothing to answer
        pass
    except Exception:  # noqa: BLE001  (any failure goes back to the parent, which raises it)
        connection.send((traceback.format_exc(), None))
    finally:
        if envs is not None:
            envs.close()
        connection.close()


class EvalWorkers:
    """num_envs evaluation envs of env_name, split as evenly as possible over `workers` processes."""

    def __init__(self, env_name, num_envs, workers):
        if num_envs < 1 or workers < 1:
            raise ValueError(f"EvalWorkers needs num_envs >= 1 and workers >= 1, got {num_envs} and {workers}")
        self.num_envs, workers = num_envs, min(workers, num_envs)
        counts = [num_envs // workers + (w < num_envs % workers) for w in range(workers)]
        self.slices = [slice(sum(counts[:w]), sum(counts[:w + 1])) for w in range(workers)]
        # fork on Linux, as gymnasium's AsyncVectorEnv does there: a script needs no __main__ guard, and the children
        # never touch the parent's CUDA (elsewhere the platform's default)
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else None)
        self.connections, self.processes = [], []
        for count in counts:
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, env_name, count), daemon=True)
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)
        self.single_observation_space, self.single_action_space = self._replies()[0]

    def _replies(self):
        """Each worker's result; a worker's failure raised here with its traceback."""
        replies = []
        for connection in self.connections:
            try:
                error, result = connection.recv()
            except EOFError:
                error, result = "the worker process ended without a reply (killed, or out of memory?)", None
            if error is not None:
                self.close()
                raise RuntimeError(f"an OGBench evaluation worker failed:\n{error}")
            replies.append(result)
        return replies

    def _gather(self, message_of):
        for connection, part in zip(self.connections, self.slices):
            connection.send(message_of(part))
        return [np.concatenate(arrays) for arrays in zip(*self._replies())]

    def reset(self, *, seed, options):
        seeds, mask, task_ids = np.asarray(seed), np.asarray(options["reset_mask"]), np.asarray(options["task_ids"])
        obs, goals = self._gather(lambda part: ("reset", (seeds[part], mask[part], task_ids[part])))
        return obs, {"goal": goals}

    def step(self, actions, running=None):
        actions = np.asarray(actions)
        running = np.ones(self.num_envs, bool) if running is None else np.asarray(running)
        message = lambda part: ("step", (actions[part], running[part]))  # noqa: E731
        obs, reward, terminated, truncated, success = self._gather(message)
        return obs, reward, terminated, truncated, {"success": success}

    def close(self):
        for connection in self.connections:
            try:
                connection.send(("close", None))
            except (BrokenPipeError, OSError):  # the worker is gone already
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        self.connections, self.processes = [], []
