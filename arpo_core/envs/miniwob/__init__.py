"""MiniWoB++ in headless Chromium: the env (`miniwob_env`), DOM reading (`dom`) and the scripted
DOM oracles that write demonstrations and grounding targets (`oracles`)."""
