"""``python -m zeroshard.config``: the table of every key (path, status, reason)."""

from zeroshard.config.training import schema_table

for info in schema_table():
    print(f"{info.path:60} {info.status.kind:9} {info.status.text}")
