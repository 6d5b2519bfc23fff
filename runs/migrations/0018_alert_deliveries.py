# Alerts are durable work: one row per outcome item and channel, written in
# the transaction that opens the item and delivered by the sweep
# (runs/alerts.py), instead of a thread started after the commit.

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0017_run_lifecycle"),
    ]

    operations = [
        migrations.CreateModel(
            name="Alert",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "channel",
                    models.CharField(
                        choices=[("email", "Email"), ("webhook", "Webhook")], max_length=10
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("pending", "Pending"),
                            ("sent", "Sent"),
                            ("failing", "Failing"),
                            ("withdrawn", "Withdrawn"),
                        ],
                        default="pending",
                        max_length=10,
                    ),
                ),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("last_error", models.TextField(blank=True)),
                (
                    "next_try_at",
                    models.DateTimeField(
                        blank=True, db_default=django.db.models.functions.datetime.Now(), null=True
                    ),
                ),
                ("sent_at", models.DateTimeField(blank=True, null=True)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "item",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="alerts",
                        to="runs.outcomeitem",
                    ),
                ),
            ],
            options={
                "ordering": ["item", "channel"],
                "indexes": [
                    models.Index(
                        condition=models.Q(("state__in", ["pending", "failing"])),
                        fields=["next_try_at"],
                        name="alert_due_idx",
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("item", "channel"), name="alert_once_per_item_channel"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(
                                ("next_try_at__isnull", False),
                                ("sent_at__isnull", True),
                                ("state__in", ["pending", "failing"]),
                            ),
                            models.Q(
                                ("next_try_at__isnull", True),
                                ("sent_at__isnull", False),
                                ("state", "sent"),
                            ),
                            models.Q(
                                ("next_try_at__isnull", True),
                                ("sent_at__isnull", True),
                                ("state", "withdrawn"),
                            ),
                            _connector="OR",
                        ),
                        name="alert_state_times",
                    ),
                ],
            },
        ),
    ]
