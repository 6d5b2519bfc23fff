"""The approval trigger (0023) runs only for a row that becomes or stays
`dispatched`: a receipt's UPDATE (state to completed) no longer calls it
just to return at its first line.  Every action's receipt paid that call,
a read's too (issue 39: the database's CPU per step)."""

from django.db import migrations

TRIGGER = """
DROP TRIGGER runs_action_approved ON runs_action;
CREATE TRIGGER runs_action_approved BEFORE INSERT OR UPDATE OF state, input_digest ON runs_action
    FOR EACH ROW WHEN (NEW.state = 'dispatched') EXECUTE FUNCTION rundesk_action_approved();
"""
UNDO = """
DROP TRIGGER runs_action_approved ON runs_action;
CREATE TRIGGER runs_action_approved BEFORE INSERT OR UPDATE OF state, input_digest ON runs_action
    FOR EACH ROW EXECUTE FUNCTION rundesk_action_approved();
"""


class Migration(migrations.Migration):
    dependencies = [("runs", "0027_retention")]

    operations = [migrations.RunSQL(TRIGGER, UNDO)]
