# Each action gets the key it is sent under (runs.models.new_idempotency_key),
# unique in the world.  An action written before this migration was sent
# under its identity, `rundesk:run-<id>:<step key>`: that stays its key, so a
# resend of it is still recognised by its receiver.

import django.db.models.functions.comparison
import django.db.models.functions.text
from django.db import migrations, models

import runs.models

BACKFILL = """
UPDATE runs_action SET idempotency_key = 'rundesk:run-' || run_id || ':' || step_key
WHERE idempotency_key IS NULL
"""


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0015_checkpoint_unknown_idx"),
    ]

    operations = [
        migrations.AddField(
            model_name="action",
            name="idempotency_key",
            field=models.TextField(null=True, editable=False),
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.AlterField(
            model_name="action",
            name="idempotency_key",
            field=models.TextField(
                db_default=django.db.models.functions.text.Concat(
                    models.Value("rundesk:"),
                    django.db.models.functions.comparison.Cast(
                        models.Func(function="gen_random_uuid"), models.TextField()
                    ),
                ),
                default=runs.models.new_idempotency_key,
                editable=False,
            ),
        ),
        migrations.AddConstraint(
            model_name="action",
            constraint=models.UniqueConstraint(
                fields=("idempotency_key",), name="action_idempotency_key_unique"
            ),
        ),
    ]
