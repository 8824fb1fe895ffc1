"""``python -m zeroshard.config``: the table of every key (path, status, reason)."""

from zeroshard.config.training import schema_table

if __name__ == "__main__":  # (importing this module prints nothing)
    for info in schema_table():
        print(f"{info.path:60} {info.status.kind:9} {info.status.text}")
