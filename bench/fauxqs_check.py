"""Does an SQS-compatible server do what fairlane's SQS backend relies on?

    python3 bench/fauxqs_check.py ENDPOINT_URL

Checks, on queues of its own (deleted at the end), each call and attribute
fairlane uses (src/queue/sqs): CreateQueue with RedrivePolicy and
VisibilityTimeout, GetQueueUrl, GetQueueAttributes (QueueArn, the three
ApproximateNumberOf* counts, RedrivePolicy), SetQueueAttributes,
SendMessageBatch with MessageGroupId on a standard queue, DelaySeconds and
message attributes, ReceiveMessage with ApproximateReceiveCount and
SentTimestamp, ChangeMessageVisibilityBatch (0 = visible again), the move
to the DLQ after maxReceiveCount receives, DeleteMessageBatch, DeleteMessage,
ListQueues. Prints one line per check, `ok` or what differs. Needs boto3.
"""

import json
import sys
import time
import uuid

import boto3

endpoint = sys.argv[1]
sqs = boto3.client(
    "sqs",
    endpoint_url=endpoint,
    region_name="us-east-1",
    aws_access_key_id="test",
    aws_secret_access_key="test",
)
prefix = f"check-{uuid.uuid4().hex[:8]}"
results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"{'ok  ' if ok else 'DIFF'} {name}{': ' + detail if detail and not ok else ''}")


dlq = sqs.create_queue(QueueName=f"{prefix}-dlq")["QueueUrl"]
dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
policy = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "2"})
url = sqs.create_queue(
    QueueName=prefix,
    Attributes={"RedrivePolicy": policy, "VisibilityTimeout": "60"},
)["QueueUrl"]
check("GetQueueUrl", sqs.get_queue_url(QueueName=prefix)["QueueUrl"] == url)
attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy", "VisibilityTimeout"])["Attributes"]
check("RedrivePolicy read back", json.loads(attrs.get("RedrivePolicy", "{}")).get("deadLetterTargetArn") == dlq_arn, str(attrs))
sqs.set_queue_attributes(QueueUrl=url, Attributes={"MessageRetentionPeriod": "3600"})
attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["MessageRetentionPeriod"])["Attributes"]
check("SetQueueAttributes", attrs.get("MessageRetentionPeriod") == "3600", str(attrs))
check("ListQueues by prefix", len(sqs.list_queues(QueueNamePrefix=prefix).get("QueueUrls", [])) == 2)

entries = [
    {
        "Id": str(i),
        "MessageBody": f"body {i}",
        "MessageGroupId": "tenant-a",
        "DelaySeconds": 0,
        "MessageAttributes": {"tenant": {"DataType": "String", "StringValue": "tenant-a"}},
    }
    for i in range(10)
]
out = sqs.send_message_batch(QueueUrl=url, Entries=entries)
check("SendMessageBatch of 10 with MessageGroupId on a standard queue", len(out.get("Successful", [])) == 10, str(out.get("Failed")))
sqs.send_message_batch(
    QueueUrl=url,
    Entries=[{"Id": "d", "MessageBody": "delayed", "DelaySeconds": 2, "MessageAttributes": {"tenant": {"DataType": "String", "StringValue": "tenant-b"}}}],
)
attrs = sqs.get_queue_attributes(
    QueueUrl=url,
    AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible", "ApproximateNumberOfMessagesDelayed"],
)["Attributes"]
check("ApproximateNumberOf* counts", (attrs.get("ApproximateNumberOfMessages"), attrs.get("ApproximateNumberOfMessagesDelayed")) == ("10", "1"), str(attrs))


def receive(n=10, visibility=60, wait=1):
    return sqs.receive_message(
        QueueUrl=url,
        MaxNumberOfMessages=n,
        WaitTimeSeconds=wait,
        VisibilityTimeout=visibility,
        MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp", "MessageGroupId"],
        MessageAttributeNames=["All"],
    ).get("Messages", [])


got = receive()
check("ReceiveMessage of 10", len(got) == 10, f"{len(got)} received")
first = got[0]
check("message attributes returned", first.get("MessageAttributes", {}).get("tenant", {}).get("StringValue") == "tenant-a", str(first.get("MessageAttributes")))
check("ApproximateReceiveCount = 1", first.get("Attributes", {}).get("ApproximateReceiveCount") == "1", str(first.get("Attributes")))
check("SentTimestamp", "SentTimestamp" in first.get("Attributes", {}), str(first.get("Attributes")))
check(
    "MessageGroupId returned on a standard queue (SQS fair queues)",
    first.get("Attributes", {}).get("MessageGroupId") == "tenant-a",
    f"not returned: {first.get('Attributes')} (fauxqs keeps no group on standard queues, so no fair-queue behaviour)",
)
attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])["Attributes"]
check("NotVisible counts received messages", attrs.get("ApproximateNumberOfMessagesNotVisible") == "10", str(attrs))

# Two back to visible at once; the rest are deleted in one batch.
back = sqs.change_message_visibility_batch(
    QueueUrl=url,
    Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": 0} for i, m in enumerate(got[:2])],
)
check("ChangeMessageVisibilityBatch", len(back.get("Successful", [])) == 2, str(back.get("Failed")))
deleted = sqs.delete_message_batch(
    QueueUrl=url,
    Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got[2:])],
)
check("DeleteMessageBatch of 8", len(deleted.get("Successful", [])) == 8, str(deleted.get("Failed")))
again = receive(visibility=0, wait=1)
again = [m for m in again if m["Body"] != "delayed"]
check("visible again after visibility 0, receive count 2", len(again) == 2 and all(m["Attributes"]["ApproximateReceiveCount"] == "2" for m in again), str([m.get("Attributes") for m in again]))
time.sleep(2.2)
third = [m for m in receive(wait=1) if m["Body"] != "delayed"]
dlq_got = sqs.receive_message(QueueUrl=dlq, MaxNumberOfMessages=10, WaitTimeSeconds=1, MessageAttributeNames=["All"]).get("Messages", [])
check("moved to the DLQ on the receive past maxReceiveCount", len(third) == 0 and len(dlq_got) == 2, f"{len(third)} received again, {len(dlq_got)} in the DLQ")
if dlq_got:
    sqs.delete_message(QueueUrl=dlq, ReceiptHandle=dlq_got[0]["ReceiptHandle"])
    check("DeleteMessage", True)
for q in (url, dlq):
    sqs.delete_queue(QueueUrl=q)
print(f"{sum(results)} of {len(results)} as SQS does")
