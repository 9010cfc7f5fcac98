// Storage account for the Functions host (AzureWebJobsStorage), the Flex Consumption deployment
// package and dbfanout's state blobs (container `db-state` by default). Keys are disabled: every
// caller authenticates with Entra ID (the app's user-assigned identity, optionally a developer).

@description('Storage account name (3-24 lowercase letters and digits).')
@minLength(3)
@maxLength(24)
param name string

@description('Azure region.')
param location string

@description('Tags applied to the account.')
param tags object = {}

@description('Blob container that holds the Flex Consumption deployment package.')
param deploymentContainerName string

@description('Blob container for dbfanout state blobs ([app] state_container in dbfanout.toml).')
param stateContainerName string = 'db-state'

@description('Storage queues of pollers with transport = "storage-queue" (each also gets its <name>-poison queue).')
param storageQueueNames array = []

@description('Days a deleted blob (for example a state blob) can be restored.')
@minValue(1)
@maxValue(365)
param blobSoftDeleteDays int = 7

resource storage 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  // checkov:skip=CKV_AZURE_35: the template has no VNet integration, so the Flex Consumption app reaches the account over its public endpoint; shared keys are off and every call needs an Entra role
  // checkov:skip=CKV_AZURE_59: same reason as CKV_AZURE_35; put the app in a VNet and add private endpoints to close the public endpoint
  // checkov:skip=CKV_AZURE_206: dbfanout state: LRS keeps cost low; losing the region's copy means restarting pollers from a chosen checkpoint (dbfanout checkpoint reset), so pick ZRS/GRS here when that is not acceptable
  name: name
  location: location
  tags: tags
  kind: 'StorageV2'
  sku: {
    name: 'Standard_LRS'
  }
  properties: {
    accessTier: 'Hot'
    allowBlobPublicAccess: false
    allowSharedKeyAccess: false
    allowCrossTenantReplication: false
    defaultToOAuthAuthentication: true
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    publicNetworkAccess: 'Enabled'
    networkAcls: {
      bypass: 'AzureServices'
      defaultAction: 'Allow'
    }
  }
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' = {
  parent: storage
  name: 'default'
  properties: {
    deleteRetentionPolicy: {
      enabled: true
      days: blobSoftDeleteDays
    }
    containerDeleteRetentionPolicy: {
      enabled: true
      days: blobSoftDeleteDays
    }
  }
}

resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: deploymentContainerName
  properties: {
    publicAccess: 'None'
  }
}

resource stateContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: stateContainerName
  properties: {
    publicAccess: 'None'
  }
}

@description('Days a claim-check blob (an oversize row, under <stateContainerName>/claims/) and a failure record (why a dead-lettered message failed, under <stateContainerName>/failures/) are kept. dbfanout never deletes claims: keep them longer than the dead-letter retention you need, or replaying an older message fails on its missing claim.')
@minValue(1)
@maxValue(3650)
param claimRetentionDays int = 30

// Claim-check blobs (oversize_policy = "claim-check") expire here, not in dbfanout: a redelivery,
// a split single or a DLQ replay may need a claim long after its first message completed. Failure
// records (why a dead-lettered message failed, shared/failures.py) expire with them.
resource lifecycle 'Microsoft.Storage/storageAccounts/managementPolicies@2023-05-01' = {
  parent: storage
  name: 'default'
  properties: {
    policy: {
      rules: [
        {
          enabled: true
          name: 'expire-claim-check-blobs'
          type: 'Lifecycle'
          definition: {
            actions: {
              baseBlob: {
                delete: {
                  daysAfterModificationGreaterThan: claimRetentionDays
                }
              }
            }
            filters: {
              blobTypes: [
                'blockBlob'
              ]
              prefixMatch: [
                '${stateContainerName}/claims/'
                '${stateContainerName}/failures/'
              ]
            }
          }
        }
      ]
    }
  }
}

output name string = storage.name
output id string = storage.id
output blobEndpoint string = storage.properties.primaryEndpoints.blob
output queueEndpoint string = storage.properties.primaryEndpoints.queue
output deploymentContainerName string = deploymentContainer.name
output stateContainerName string = stateContainer.name

// Pollers on the storage-queue transport: their queue, and the poison queue the Functions host
// moves a message to after maxDequeueCount failed attempts (created here so `dbfanout dlq` finds it).
resource queueService 'Microsoft.Storage/storageAccounts/queueServices@2023-05-01' = if (!empty(storageQueueNames)) {
  parent: storage
  name: 'default'
}

resource storageQueues 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = [for q in storageQueueNames: if (!empty(storageQueueNames)) {
  parent: queueService
  name: q
}]

resource poisonQueues 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = [for q in storageQueueNames: if (!empty(storageQueueNames)) {
  parent: queueService
  name: '${q}-poison'
}]
