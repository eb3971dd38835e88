"""A target role that is not a superuser (a managed database's): told every grant it lacks
before anything changes, and replicating once they are given."""

from __future__ import annotations

import re
import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgcdc_dagster.engine.apply.origin import OriginError
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster_tests.support.replication import catch_up, equal_tables, settings_for


def test_a_target_role_without_origin_rights_is_told_each_grant_then_replicates(
    source_dsn, target_dsn, spark, tmp_path
):
    role = f"pgcdc_target_{uuid.uuid4().hex[:8]}"
    database = conninfo_to_dict(target_dsn)["dbname"]
    with psycopg.connect(target_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
                sql.Identifier(database), sql.Identifier(role)
            )
        )
        try:
            with psycopg.connect(source_dsn, autocommit=True) as src:
                src.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
                src.execute("INSERT INTO a VALUES (1, 'one')")
            as_role = make_conninfo(target_dsn, user=role)
            settings = settings_for(source_dsn, as_role, tmp_path, "role")
            with pytest.raises(OriginError) as refused:
                pipeline.take_snapshot(settings, spark)
            message = str(refused.value)
            assert f"role {role} may not keep the target's replication origin" in message
            assert f"in database {database}" in message
            assert admin.execute("SELECT to_regclass('public.a')").fetchone() == (None,)

            # The grants as the message words them, run as it says, let the snapshot through.
            grants = re.search(r" run (GRANT .*); or connect as a superuser", message)
            assert grants is not None, message
            assert grants.group(1).count("GRANT ") == 3, message
            admin.execute(grants.group(1).encode())
            pipeline.take_snapshot(settings, spark)
            with psycopg.connect(source_dsn, autocommit=True) as src:
                src.execute("INSERT INTO a VALUES (2, 'two'); UPDATE a SET v = 'uno' WHERE id = 1")
            catch_up(settings)
            assert equal_tables(settings) == [("public.a", True)]
            assert admin.execute("SELECT count(*) FROM a").fetchone() == (2,)
        finally:
            admin.execute(
                sql.SQL("ALTER DATABASE {} OWNER TO CURRENT_USER").format(sql.Identifier(database))
            )
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(
                sql.SQL("REVOKE SET ON PARAMETER session_replication_role FROM {}").format(
                    sql.Identifier(role)
                )
            )
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
