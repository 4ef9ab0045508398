"""FlexLoop's environments, registered with gymnasium on import.

    import gymnasium as gym, envs, torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vec_env = gym.make_vec("BoxPick-Exact-4-v0", num_envs=1024, device=device, split="unseen")

Each id makes a batched vector env whose state lives on `device`.
"""

import gymnasium as gym

from envs.boxpick import VARIANTS as BOXPICK_VARIANTS

BOXPICK_IDS = {f"BoxPick-{variant}-v0": variant for variant in BOXPICK_VARIANTS}
LIGHTSOUT_ID = "LightsOut-4x5-v0"
ENV_IDS = [*BOXPICK_IDS, LIGHTSOUT_ID]

for _env_id, _variant in BOXPICK_IDS.items():
    if _env_id not in gym.registry:
        gym.register(_env_id, entry_point=None, vector_entry_point="envs.boxpick:BoxPickVecEnv",
                     kwargs={"variant": _variant})
if LIGHTSOUT_ID not in gym.registry:
    gym.register(LIGHTSOUT_ID, entry_point=None, vector_entry_point="envs.lightsout:LightsOutVecEnv")


def make_vec(env_id, num_envs, **kwargs):
    """gym.make_vec with an error that lists FlexLoop's ids when the id is unknown."""
    if env_id not in ENV_IDS:
        raise ValueError(f"unknown env id {env_id!r}; FlexLoop registers {ENV_IDS}")
    return gym.make_vec(env_id, num_envs=num_envs, **kwargs)
