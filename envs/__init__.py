"""FlexLoop's environments, registered with gymnasium on import.

    import gymnasium as gym, envs, torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vec_env = gym.make_vec("BoxPick-Exact-4-v0", num_envs=1024, device=device, split="unseen")

Each id makes a batched vector env whose state lives on `device`.
"""

from functools import partial

import gymnasium as gym

from envs.boxpick import VARIANTS as BOXPICK_VARIANTS

BOXPICK_IDS = {f"BoxPick-{variant}-v0": variant for variant in BOXPICK_VARIANTS}
LIGHTSOUT_ID = "LightsOut-4x5-v0"
ENV_IDS = [*BOXPICK_IDS, LIGHTSOUT_ID]


def vector_only(env_id, **kwargs):
    """What gym.make makes of these ids: an error that names gym.make_vec. Each id is a whole batch of envs that
    steps as tensor ops, so there is no single-env form."""
    raise ValueError(f"{env_id} is a batched vector env only, so gym.make cannot make it; use "
                     f"gym.make_vec({env_id!r}, num_envs=1024, device='cpu') (or device='cuda'), after `import envs`")


for _env_id, _variant in BOXPICK_IDS.items():
    if _env_id not in gym.registry:
        gym.register(_env_id, entry_point=partial(vector_only, _env_id),
                     vector_entry_point="envs.boxpick:BoxPickVecEnv", kwargs={"variant": _variant})
if LIGHTSOUT_ID not in gym.registry:
    gym.register(LIGHTSOUT_ID, entry_point=partial(vector_only, LIGHTSOUT_ID),
                 vector_entry_point="envs.lightsout:LightsOutVecEnv")


def make_vec(env_id, num_envs, **kwargs):
    """gym.make_vec with an error that lists FlexLoop's ids when the id is unknown."""
    if env_id not in ENV_IDS:
        raise ValueError(f"unknown env id {env_id!r}; FlexLoop registers {ENV_IDS}")
    return gym.make_vec(env_id, num_envs=num_envs, **kwargs)
