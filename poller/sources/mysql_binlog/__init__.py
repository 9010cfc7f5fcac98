"""The mysql_binlog source: a MariaDB/MySQL row binlog read as a replica."""
