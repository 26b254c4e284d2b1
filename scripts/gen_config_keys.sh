#!/usr/bin/env bash
# Regenerate common/ops/config_keys.json, every subcommand's config keys, after a CLI option changes:
# a node's parser holds its own subcommand only, and checks the other tables of a shared config
# file against this list.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-.venv/bin/python}" -c '
import json
from client.cli.main import build_parser
from common.ops.config import KEYS_FILE, config_keys
KEYS_FILE.write_text(json.dumps(config_keys(build_parser()), indent=1) + "\n")
'
