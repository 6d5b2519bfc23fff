# The database refuses a change of a run's status its lifecycle does not
# allow (runs/lifecycle.py: TRANSITIONS, the one source of the trigger).  A
# later change of the table installs the trigger again in a migration of its
# own (trigger_sql is CREATE OR REPLACE).

from django.db import migrations

from runs import lifecycle


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0016_action_idempotency_key"),
    ]

    operations = [
        migrations.RunSQL(lifecycle.trigger_sql(), lifecycle.DROP_TRIGGER_SQL),
    ]
