"""OSWorld desktops: the env over OSWorld's HTTP protocol and its task files (`osworld_env`), the
evaluator functions (`osworld_evaluators`), the project's own local Xvfb desktop server
(`desktop_server`) and the bridge to the official desktop-env package (`desktop_env_bridge`)."""
