"""Where the browser the MiniWoB envs drive is installed (Debian's Chromium and its driver, which `make setup`
installs with apt), in a module that imports nothing, so that code naming the browser without starting one
(a run's environment tags, tracking/mlflow_runs.py) does not import Selenium."""

CHROMIUM_BINARY = "/usr/lib/chromium/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
