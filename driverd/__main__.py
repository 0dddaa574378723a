from driverd.cli import entry

entry()
