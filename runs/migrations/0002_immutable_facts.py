# Receipts and answer revisions are facts: the database refuses to change or
# delete them, whoever asks (the ORM, the admin, psql).  Run events are an
# append-only timeline: they cannot be changed.  TRUNCATE (test teardown) is
# a table-level operation and does not fire these row triggers.

from django.db import migrations

FUNCTION = """
CREATE FUNCTION rundesk_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rundesk: % on % is refused: its rows are immutable', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END
$$;
"""

TRIGGERS = [
    ("runs_receipt", "UPDATE OR DELETE"),
    ("runs_answerrevision", "UPDATE OR DELETE"),
    ("runs_runevent", "UPDATE"),
]


class Migration(migrations.Migration):
    dependencies = [("runs", "0001_initial")]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION rundesk_refuse_change();"),
        *[
            migrations.RunSQL(
                f"CREATE TRIGGER {table}_immutable BEFORE {ops} ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION rundesk_refuse_change();",
                f"DROP TRIGGER {table}_immutable ON {table};",
            )
            for table, ops in TRIGGERS
        ],
    ]
