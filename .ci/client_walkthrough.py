"""The README's walk-through, through a Python client generated from
openapi/openapi.json by openapi-python-client: if the document and the
service disagree, a call here fails or a typed answer does not parse.

    python client_walkthrough.py BASE_URL ADMIN_TOKEN   (client package on sys.path)
"""

import datetime
import sys

from fairlane_client import AuthenticatedClient
from fairlane_client.api.admin import add_sender, create_tenant, get_tenant, issue_key, put_plan, queues
from fairlane_client.api.attachments import delete_attachment, get_attachment
from fairlane_client.api.templates import create_own, preview
from fairlane_client.api.messages import (
    cancel_by_reference,
    cancel_message,
    get_message,
    send_batch,
    send_message,
)
from fairlane_client.models import (
    AttachmentView,
    Preview,
    PreviewRequest,
    PreviewRequestPersonalisationType0,
    SendEmailRequestByTemplatePersonalisationType0,
    EmailTemplateContent,
    EmailTemplateContentChannel,
    EmailTemplateContentLocales,
    TemplateView,
    BatchSmsItemByContent,
    IssueKey,
    KeyKind,
    NewSmsSender,
    NewSmsSenderChannel,
    SenderIdentity,
    BatchSmsItemByContentChannel,
    CreateTenant,
    Lane,
    MessageStatus,
    PlanInput,
    Priority,
    Problem,
    SendAccepted,
    SendBatchRequest,
    SendEmailRequestByContent,
    SendEmailRequestByContentChannel,
    SendEmailRequestByTemplate,
    SendEmailRequestByTemplateChannel,
    SendSmsRequestByContent,
    SendSmsRequestByContentChannel,
)


def expect(value, kind, what):
    if not isinstance(value, kind):
        raise SystemExit(f"{what}: expected {kind.__name__}, got {value!r}")
    return value


base, admin_token = sys.argv[1], sys.argv[2]
admin = AuthenticatedClient(base_url=base, token=admin_token)
put_plan.sync(
    "walk",
    client=admin,
    body=PlanInput(lane=Lane.FAST, rate_per_second=100.0, burst=50, daily_quota=10000, max_in_flight=4),
)
create_tenant.sync(client=admin, body=CreateTenant(id="walk", name="Walk-through", plan="walk"))
key = issue_key.sync("walk", client=admin).key
tenant = AuthenticatedClient(base_url=base, token=key)

email = expect(
    send_message.sync(
        client=tenant,
        body=SendEmailRequestByContent(
            channel=SendEmailRequestByContentChannel.EMAIL,
            to="someone@example.com",
            subject="Your receipt",
            text="Thanks for your order.",
            priority=Priority.HIGH,
            reference="order-1234",
        ),
        idempotency_key="walk-email-1",
    ),
    SendAccepted,
    "send an email",
)
assert email.status == MessageStatus.QUEUED, email
later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
sms = expect(
    send_message.sync(
        client=tenant,
        body=SendSmsRequestByContent(
            channel=SendSmsRequestByContentChannel.SMS, to="+15551234567", text="Your code is 123456", send_at=later
        ),
    ),
    SendAccepted,
    "schedule an SMS",
)
assert sms.status == MessageStatus.SCHEDULED, sms
refused = expect(
    send_message.sync(
        client=tenant,
        body=SendSmsRequestByContent(channel=SendSmsRequestByContentChannel.SMS, to="+0", text="x"),
    ),
    Problem,
    "a bad number is refused",
)
assert refused.status == 422 and "to" in refused.errors.additional_properties, refused

batch = send_batch.sync(
    client=tenant,
    body=SendBatchRequest(
        messages=[
            BatchSmsItemByContent(channel=BatchSmsItemByContentChannel.SMS, to="+15551234567", text="one", reference="blast"),
            BatchSmsItemByContent(channel=BatchSmsItemByContentChannel.SMS, to="not a number", text="two", reference="blast"),
            BatchSmsItemByContent(
                channel=BatchSmsItemByContentChannel.SMS, to="+15551234568", text="three", reference="blast",
                idempotency_key="walk-item-3", send_at=later,
            ),
        ]
    ),
    idempotency_key="walk-batch-1",
)
assert (batch.accepted, batch.refused) == (2, 1), batch
assert [r.status for r in batch.results] == [202, 422, 202], batch

status = get_message.sync(email.id, client=tenant)
assert status.id == email.id and status.reference == "order-1234", status
cancelled = cancel_message.sync(sms.id, client=tenant)
assert cancelled.status == MessageStatus.CANCELLED, cancelled
again = expect(cancel_message.sync(sms.id, client=tenant), Problem, "a second cancel")
assert again.status == 409, again
by_reference = cancel_by_reference.sync(client=tenant, reference="blast")
assert by_reference.cancelled == 2, by_reference

# A sender identity, named in a send made with a test key: accepted,
# marked as a test, and never given to a provider.
sender = expect(
    add_sender.sync("walk", client=admin, body=NewSmsSender(channel=NewSmsSenderChannel.SMS, from_="WALK")),
    SenderIdentity,
    "add a sender identity",
)
test_key = issue_key.sync("walk", client=admin, body=IssueKey(kind=KeyKind.TEST))
assert test_key.kind == KeyKind.TEST and test_key.key.startswith("fl_test_"), test_key
tester = AuthenticatedClient(base_url=base, token=test_key.key)
trial = expect(
    send_message.sync(
        client=tester,
        body=SendSmsRequestByContent(
            channel=SendSmsRequestByContentChannel.SMS, to="+15005550001", text="Trying it out", sender_id=sender.id
        ),
    ),
    SendAccepted,
    "send with a test key and a sender identity",
)
assert get_message.sync(trial.id, client=tester).test is True, trial
foreign = expect(
    send_message.sync(
        client=tenant,
        body=SendSmsRequestByContent(channel=SendSmsRequestByContentChannel.SMS, to="+15551234567", text="x", sender_id="snd_none"),
    ),
    Problem,
    "an unknown sender identity is refused",
)
assert foreign.status == 422 and "sender_id" in foreign.errors.additional_properties, foreign

# A template with a French variant, previewed, then sent by id with
# personalisation: the send takes the template's priority, and its status
# names the template and the version it was rendered from.
template = expect(
    create_own.sync(
        client=tenant,
        body=EmailTemplateContent(
            name="receipt",
            channel=EmailTemplateContentChannel.EMAIL,
            priority=Priority.HIGH,
            subject="Your receipt, ((name))",
            text="Thanks for order ((order)).",
            html="<p>Thanks for order <b>((order))</b>, ((name)).</p>",
            locales=EmailTemplateContentLocales.from_dict(
                {"fr": {"subject": "Votre reçu, ((name))", "text": "Merci pour la commande ((order))."}}
            ),
        ),
    ),
    TemplateView,
    "create a template",
)
assert template.version == 1 and template.placeholders == ["name", "order"], template
values = {"name": "Ann", "order": "A-1"}
shown = expect(
    preview.sync(
        template.id,
        client=tenant,
        body=PreviewRequest(locale="fr-CA", personalisation=PreviewRequestPersonalisationType0.from_dict(values)),
    ),
    Preview,
    "preview a template",
)
assert (shown.locale, shown.subject) == ("fr", "Votre reçu, Ann"), shown
by_template = expect(
    send_message.sync(
        client=tenant,
        body=SendEmailRequestByTemplate(
            channel=SendEmailRequestByTemplateChannel.EMAIL,
            to="someone@example.com",
            template_id=template.id,
            personalisation=SendEmailRequestByTemplatePersonalisationType0.from_dict(values),
        ),
    ),
    SendAccepted,
    "send by template",
)
assert by_template.priority == Priority.HIGH, by_template
sent_by_template = get_message.sync(by_template.id, client=tenant)
assert (sent_by_template.template_id, sent_by_template.template_version) == (template.id, 1), sent_by_template
missing = expect(
    send_message.sync(
        client=tenant,
        body=SendEmailRequestByTemplate(
            channel=SendEmailRequestByTemplateChannel.EMAIL, to="someone@example.com", template_id=template.id
        ),
    ),
    Problem,
    "a send missing a placeholder is refused",
)
assert missing.status == 422 and "personalisation.name" in missing.errors.additional_properties, missing

# A file uploaded as it is (the body is its bytes, which the generated
# client's raw HTTP client sends: the operation takes eight media types and
# no JSON), then named in a send; the answer and the file's view parse as
# the document says.
pdf = b"%PDF-1.7\n" + bytes(range(256)) * 64 + b"\n%%EOF"
uploaded = tenant.get_httpx_client().post(
    "/v1/attachments",
    params={"filename": "../Invoice 17.pdf"},
    content=pdf,
    headers={"Content-Type": "application/pdf"},
)
assert uploaded.status_code == 201, uploaded.text
file = AttachmentView.from_dict(uploaded.json())
assert (file.filename, file.size) == ("Invoice 17.pdf", len(pdf)), file
with_file = expect(
    send_message.sync(
        client=tenant,
        body=SendEmailRequestByContent(
            channel=SendEmailRequestByContentChannel.EMAIL,
            to="someone@example.com",
            subject="Invoice 17",
            text="Attached.",
            attachments=[file.id],
        ),
    ),
    SendAccepted,
    "send with an attachment",
)
# The same file serves a second send, and its view counts both; once
# deleted (204), a send naming it is refused on the field.
again = expect(
    send_message.sync(
        client=tenant,
        body=SendEmailRequestByContent(
            channel=SendEmailRequestByContentChannel.EMAIL, to="someone@example.com", subject="Again", text="x", attachments=[file.id]
        ),
    ),
    SendAccepted,
    "a second send with the same file",
)
used = expect(get_attachment.sync(file.id, client=tenant), AttachmentView, "read an attachment")
assert used.messages == 2, used
deleted = delete_attachment.sync_detailed(file.id, client=tenant)
assert deleted.status_code == 204, deleted
refused = expect(
    send_message.sync(
        client=tenant,
        body=SendEmailRequestByContent(
            channel=SendEmailRequestByContentChannel.EMAIL, to="someone@example.com", subject="Gone", text="x", attachments=[file.id]
        ),
    ),
    Problem,
    "a deleted file is refused",
)
assert refused.status == 422 and "attachments[0]" in refused.errors.additional_properties, refused

assert get_tenant.sync("walk", client=admin).id == "walk"
assert queues.sync(client=admin) is not None
print("client walk-through: every call answered as the document says")
