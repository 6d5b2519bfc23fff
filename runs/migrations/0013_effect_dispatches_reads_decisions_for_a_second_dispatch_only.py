# The trigger that counts an effect's dispatches (migration 0008) reads the
# operators' decisions only for a dispatch after the first: an effect's
# first boundary (attempts = 1) needs no decision, and a new action can have
# none.  Before, every delivery's boundary read runs_operatordecision, so a
# lock anyone held on that table held the delivery, and its run, until the
# lease ran out.  What it refuses is unchanged.

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION rundesk_effect_dispatches() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.effect_class = 'effect' AND NEW.attempts > 1 THEN
        IF NEW.attempts > 1 + (
            SELECT count(*) FROM runs_operatordecision d
            WHERE d.action_id = NEW.id
              AND d.choice IN ('resend_same_identity', 'confirmed_not_happened'))
        THEN
            RAISE EXCEPTION 'rundesk: action_effect_dispatched_once: effect % would be '
                'dispatched % times; each dispatch after the first needs an operator''s decision',
                NEW.step_key, NEW.attempts
                USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    RETURN NEW;
END
$$;
"""

BEFORE = """
CREATE OR REPLACE FUNCTION rundesk_effect_dispatches() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.effect_class = 'effect' AND NEW.attempts > 1 + (
        SELECT count(*) FROM runs_operatordecision d
        WHERE d.action_id = NEW.id
          AND d.choice IN ('resend_same_identity', 'confirmed_not_happened'))
    THEN
        RAISE EXCEPTION 'rundesk: action_effect_dispatched_once: effect % would be dispatched % '
            'times; each dispatch after the first needs an operator''s decision',
            NEW.step_key, NEW.attempts
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0012_one_drill_running"),
    ]

    operations = [migrations.RunSQL(FUNCTION, BEFORE)]
