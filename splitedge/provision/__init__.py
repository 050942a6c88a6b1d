"""`splitedge provision`: everything a fleet needs to run, written once per node.

One bundle per node (its TOML config, login, keys, data, a systemd unit) and the broker's files,
with an ACL that confines every login to its own node's topics in whatever run it joins, so the
same broker serves run after run of these nodes without being touched (deploy/README.md,
"Provisioning").
"""
