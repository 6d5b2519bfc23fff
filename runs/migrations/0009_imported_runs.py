# Imported runs (evidence/opening.py): a run opened from another
# installation's investigation bundle, marked with its origin and seal.  It
# keeps its status but is never owned here (run_imported_never_owned: a claim
# of one fails in the database, whatever query picked it), so a `running`
# imported run needs no owner (run_running_has_owner); one run per bundle
# (run_import_seal_unique).
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0008_operator_decisions"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="run",
            name="run_running_has_owner",
        ),
        migrations.AddField(
            model_name="run",
            name="imported_at",
            field=models.DateTimeField(blank=True, help_text="Set: an imported run", null=True),
        ),
        migrations.AddField(
            model_name="run",
            name="origin_exported_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="run",
            name="origin_format",
            field=models.CharField(blank=True, max_length=40),
        ),
        migrations.AddField(
            model_name="run",
            name="origin_installation",
            field=models.CharField(blank=True, max_length=200),
        ),
        migrations.AddField(
            model_name="run",
            name="origin_manifest",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="run",
            name="origin_run_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="run",
            name="origin_seal",
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("status", "running"), _negated=True),
                    ("imported_at__isnull", False),
                    models.Q(
                        models.Q(("lease_owner", ""), _negated=True),
                        ("lease_expires_at__isnull", False),
                    ),
                    _connector="OR",
                ),
                name="run_running_has_owner",
            ),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("imported_at__isnull", True), ("lease_owner", ""), _connector="OR"
                ),
                name="run_imported_never_owned",
            ),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("imported_at__isnull", True),
                        ("origin_exported_at__isnull", True),
                        ("origin_run_id__isnull", True),
                        ("origin_seal", ""),
                    ),
                    models.Q(
                        ("imported_at__isnull", False),
                        ("origin_exported_at__isnull", False),
                        ("origin_run_id__isnull", False),
                        models.Q(("origin_seal", ""), _negated=True),
                    ),
                    _connector="OR",
                ),
                name="run_imported_has_origin",
            ),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.UniqueConstraint(
                condition=models.Q(("origin_seal", ""), _negated=True),
                fields=("origin_seal",),
                name="run_import_seal_unique",
            ),
        ),
    ]
